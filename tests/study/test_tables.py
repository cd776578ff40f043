"""Table writers: Markdown/CSV output and the Table-2 aggregation."""

import csv

import pytest

from dsv4flash.study.tables import TABLE2_COLUMNS, markdown_table, table2_rows, write_tables


def _run(variant, seed, plateau, params=100, step=0.5, peak=2**20):
    return {"variant": variant, "seed": seed, "plateau_val_loss": plateau, "final_val_loss": plateau - 0.1,
            "trainable_params": params, "master_bytes": 4 * params, "step_time_median_s": step,
            "peak_mem_bytes": peak}


def test_table2_rows_aggregate_across_seeds():
    results = [_run("full_linear", 0, 0.30), _run("full_linear", 1, 0.28), _run("full_linear", 2, 0.29),
               _run("decoder_half", 1, 0.33, params=50, step=0.3, peak=3 * 2**20), _run("decoder_half", 0, 0.31,
                                                                                         params=50, step=0.2)]
    rows = table2_rows(results, ["full_linear", "decoder_half", "never_ran"], "full_linear")
    assert [r["placement"] for r in rows] == ["full_linear", "decoder_half"]
    full, dec = rows
    assert full["seeds"] == 3 and full["plateau_val_loss"] == pytest.approx(0.29)
    assert full["range"] == pytest.approx(0.02) and full["min_seed"] == 0.28 and full["max_seed"] == 0.30
    assert full["delta_vs_ref"] == pytest.approx(0.0)
    assert dec["plateau_val_loss"] == pytest.approx(0.32) and dec["delta_vs_ref"] == pytest.approx(0.03)
    assert dec["master_MiB"] == pytest.approx(200 / 2**20) and dec["step_time_s"] == pytest.approx(0.25)
    assert dec["peak_mem_MiB"] == pytest.approx(3.0)
    assert set(TABLE2_COLUMNS) <= set(full)


def test_write_tables_markdown_and_csv(tmp_path):
    rows = [{"a": "x|y", "b": 1234567, "c": 0.123456, "d": None}, {"a": "z", "b": 2, "c": float("nan"), "d": 1.5}]
    md, path_csv = write_tables(tmp_path / "t", rows, ["a", "b", "c", "d"], title="T", notes=["n1"], digits=3)
    text = md.read_text()
    assert text.startswith("# T\n\n| a | b | c | d |\n|---|---|---|---|\n")
    assert "| x\\|y | 1,234,567 | 0.123 | — |" in text and "| z | 2 | — | 1.500 |" in text and "- n1" in text
    with open(path_csv) as handle:
        back = list(csv.DictReader(handle))
    assert back[0] == {"a": "x|y", "b": "1234567", "c": "0.123456", "d": ""}
    assert not list(tmp_path.glob(".*tmp"))  # temp files renamed away


def test_markdown_table_names_a_missing_column():
    with pytest.raises(KeyError, match=r"row 1 lacks columns \['b'\]"):
        markdown_table([{"a": 1, "b": 2}, {"a": 3}], ["a", "b"])
