"""ci/pip_conflicts.py: the --no-deps installs' known conflicts become one note; every other line of pip's stderr
is kept, and an unknown conflict keeps pip's header."""

import runpy
from pathlib import Path

FILTER = runpy.run_path(str(Path(__file__).resolve().parents[2] / "ci" / "pip_conflicts.py"))
HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
          "installed. This behaviour is the source of the following dependency conflicts.")


def test_known_conflicts_are_dropped_and_everything_else_is_kept():
    lines = [HEADER,
             "megatron-bridge 0.6.2 requires mlflow, which is not installed.",
             "tinker-cookbook 0.6.1 requires tml-renderers, which is not installed.",
             "vllm 0.33.0 requires torch==2.14.0, but you have torch 2.13.0+cpu which is incompatible.",
             "WARNING: Running pip as the 'root' user"]
    kept, dropped = FILTER["filter_lines"](lines)
    assert kept == ["WARNING: Running pip as the 'root' user"] and dropped == lines[1:4]


def test_an_unknown_conflict_keeps_the_header_and_its_line():
    lines = [HEADER, "vllm 0.33.0 requires torchvision, which is not installed.",
             "verl 0.9.1 requires tensordict<=0.10, but you have tensordict 0.11 which is incompatible.",
             "megatron-bridge 0.7.0 requires mlflow, which is not installed."]  # another version: not known
    kept, dropped = FILTER["filter_lines"](lines)
    assert kept == [HEADER, lines[2], lines[3]] and dropped == [lines[1]]


def test_the_note_is_printed_once_per_install(tmp_path, capsys, monkeypatch):
    import io

    note = tmp_path / "note"
    for _ in range(2):
        monkeypatch.setattr("sys.stdin", io.StringIO(HEADER + "\nvllm 0.33.0 requires nvtx, which is not installed.\n"))
        assert FILTER["main"](["--note-once", str(note)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[install] note: pip lists 1 dependency conflict(s) of vllm 0.33.0")
