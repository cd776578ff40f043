"""`dsv4flash lifecycle export --format peft|vllm|megatron|packed|vllm_3d` takes a training output (or any adapter
directory) without a store, and a round trip between any two formats is bit-exact."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from dsv4flash.cli import main
from dsv4flash.lifecycle.export import FORMATS, export_adapter_dir, import_vllm_3d
from dsv4flash.lora import LoraConfig, apply_lora, load_peft_adapter, lora_parameters, lora_state_dict, save_peft_adapter
from dsv4flash.model.transformer import Transformer


def _training_output(tmp_path, cfg: LoraConfig):
    """What `python -m dsv4flash.train` leaves: <out>/adapter (its writer) next to the run's other files."""
    model = Transformer("tiny", seed=0)
    handle = apply_lora(model, cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
    out = tmp_path / "run"
    save_peft_adapter(model, handle, out / "adapter", base_model_name_or_path="/bases/tiny")
    (out / "revision.json").write_text(json.dumps({"adapter": str(out / "adapter")}))
    return out, lora_state_dict(model)


def _bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _loaded(directory, fmt):
    """The canonical tensors a directory holds, read back by dsv4flash's own loaders."""
    if fmt == "vllm_3d":
        return import_vllm_3d(directory).to_packed_tensors()
    model = Transformer("tiny", seed=0)
    load_peft_adapter(model, directory)
    return lora_state_dict(model)


def test_cli_exports_a_training_output_in_every_format_without_a_store(tmp_path, capsys):
    out, canonical = _training_output(tmp_path, LoraConfig(preset="decoder_half", rank=4))
    before = sorted(os.listdir(out))
    for fmt in FORMATS:
        assert main(["lifecycle", "export", str(out), str(tmp_path / fmt), "--format", fmt]) == 0
        assert capsys.readouterr().out.strip() == str(tmp_path / fmt)
        assert _bit_equal(_loaded(tmp_path / fmt, fmt), canonical), fmt
    assert sorted(os.listdir(out)) == before  # no store (blobs/, catalog) created in the training output
    config = json.loads((tmp_path / "vllm" / "adapter_config.json").read_text())
    assert "target_parameters" not in config and config["rank_pattern"] == {}  # wo_a stays at rank r for vLLM
    assert config["base_model_name_or_path"] == "/bases/tiny"


@pytest.mark.parametrize("cfg", [LoraConfig(preset="full_linear", rank=2),
                                 LoraConfig(preset="vit_lr_0p1", rank=2, lora_dtype="bfloat16", wo_a_lora="shared_a")])
def test_round_trip_between_any_two_formats_is_bit_exact(tmp_path, cfg):
    out, canonical = _training_output(tmp_path, cfg)
    for a, b in itertools.product(FORMATS, FORMATS):
        first = export_adapter_dir(out, tmp_path / f"{a}-{b}" / "a", a)
        other = export_adapter_dir(first, tmp_path / f"{a}-{b}" / "b", b)
        again = export_adapter_dir(other, tmp_path / f"{a}-{b}" / "a2", a)
        assert _bit_equal(load_file(str(again / "adapter_model.safetensors")),
                          load_file(str(first / "adapter_model.safetensors"))), (a, b)
        assert (again / "adapter_config.json").read_text() == (first / "adapter_config.json").read_text(), (a, b)
        assert _bit_equal(_loaded(other, b), canonical), (a, b)


def test_export_user_errors_exit_2_naming_the_problem(tmp_path, capsys, empty_default_store):
    from dsv4flash.lifecycle.default_store import default_store

    out, _ = _training_output(tmp_path, LoraConfig(preset="decoder_half", rank=2, expert_lora="shared_outer"))

    def run(*argv):
        code = main(["lifecycle", "export", *argv])
        return code, capsys.readouterr().err

    code, err = run(str(tmp_path / "nowhere"), str(tmp_path / "x"))  # no store at the default root either
    assert code == 2 and f"{tmp_path / 'nowhere'} is not a directory, and there is no store at " in err
    (tmp_path / "empty").mkdir()
    code, err = run(str(tmp_path / "empty"), str(tmp_path / "x"))
    assert code == 2 and "neither an adapter directory (adapter_config.json) nor a training output" in err
    assert run(str(out), str(tmp_path / "p"))[0] == 0
    code, err = run(str(out), str(tmp_path / "p"))
    assert code == 2 and "exists (pass overwrite=True" in err
    code, err = run(str(out), str(tmp_path / "v3"), "--format", "vllm_3d")  # packs experts [E, r, in] only
    assert code == 2 and "shares factors across experts (expert_lora='shared_outer')" in err
    assert not (tmp_path / "v3").exists()
    code, err = main(["lifecycle", "policies"]), capsys.readouterr().err  # the default store does not exist yet
    assert code == 2 and "no adapter store here" in err and str(default_store()) in err


def test_export_checks_the_directory_against_its_placement(tmp_path, capsys):
    """A training output missing a module the placement adapts is refused, not converted without it."""
    out, _ = _training_output(tmp_path, LoraConfig(preset="decoder_half", rank=2))
    weights = out / "adapter" / "adapter_model.safetensors"
    from safetensors.torch import save_file

    save_file({k: v for k, v in load_file(str(weights)).items() if ".layers.9.attn.wo_a." not in k}, str(weights))
    assert main(["lifecycle", "export", str(out), str(tmp_path / "v"), "--format", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "missing ['layers.9.attn.wo_a.lora_A.weight', 'layers.9.attn.wo_a.lora_B.weight']" in err
    assert "the placement adapts layers.9.attn.wo_a" in err and not (tmp_path / "v").exists()


def test_cli_imports_training_outputs_and_adapter_directories_into_a_store(empty_default_store, tmp_path, capsys):
    """`dsv4flash lifecycle import DIR`: a training output and an adapter directory of another layout become
    bit-exact revisions tagged latest, carrying the placement the server rebuilds; without --root into the default
    store (created), with --root only into an existing one; a bad directory exits 2 naming the file."""
    import shutil

    from dsv4flash.lifecycle import AdapterStore
    from dsv4flash.lifecycle.default_store import default_store

    out, canonical = _training_output(tmp_path, LoraConfig(preset="decoder_half", rank=4))
    placement = json.loads((out / "adapter" / "dsv4flash_adapter.json").read_text())["lora_config"]
    assert main(["lifecycle", "export", str(out), str(tmp_path / "meg"), "--format", "megatron"]) == 0
    assert main(["lifecycle", "import", str(out)]) == 0  # the default store, created by the import
    assert main(["lifecycle", "import", str(tmp_path / "meg"), "--policy", "meg-layout"]) == 0
    printed = capsys.readouterr().out
    assert f"run:latest = " in printed and f"store {default_store()}" in printed
    with AdapterStore.open(default_store()) as store:
        for policy in ("run", "meg-layout"):
            rev = store.resolve(f"{policy}:latest")
            assert rev.parent is None and store.policy(policy).head == rev.id
            assert _bit_equal(store.load_adapter(rev.id).to_packed_tensors(), canonical), policy
            assert store.load(rev.id).manifest.extra["placement"] == placement

    def fails(*argv):
        code = main(["lifecycle", *argv])
        return code, capsys.readouterr().err

    code, err = fails("--root", str(tmp_path / "typo"), "import", str(out))
    assert code == 2 and "no adapter store here" in err and not (tmp_path / "typo").exists()
    code, err = fails("import", str(tmp_path / "nowhere"))
    assert code == 2 and f"{tmp_path / 'nowhere'}: not a directory" in err
    (tmp_path / "empty").mkdir()
    code, err = fails("import", str(tmp_path / "empty"))
    assert code == 2 and "neither an adapter directory (adapter_config.json) nor a training output" in err
    stock = shutil.copytree(out / "adapter", tmp_path / "stock")
    (stock / "dsv4flash_adapter.json").unlink()  # what PEFT alone writes: no placement
    code, err = fails("import", str(stock))
    assert code == 2 and f"{stock / 'dsv4flash_adapter.json'}: missing or without a lora_config" in err
    broken = shutil.copytree(out / "adapter", tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    code, err = fails("import", str(broken))
    assert code == 2 and f"{broken / 'adapter_model.safetensors'}: unreadable safetensors file" in err
    with AdapterStore.open(default_store()) as store:
        assert sorted(store.catalog.list_policies()) == ["meg-layout", "run"]  # nothing half-imported
