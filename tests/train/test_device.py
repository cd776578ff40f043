"""Where the embedded engines compute (dsv4flash/engine/device.py): the auto/explicit resolution, user errors, and
that on a machine without CUDA the auto default is the very CPU float32 computation the engines always ran."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dsv4flash.engine.device import DeviceForward, on_device, resolve_compute
from dsv4flash.train.compose import compose, to_train_config

SMALL = ["model.base=random", "engine.steps=2", "engine.batch_size=2", "engine.eval_every=2", "engine.log_every=1",
         "engine.checkpoint_every=0", "data.val_size=4", "engine.eval_generate=false", "engine.progress=off",
         "lora.rank=4", "lifecycle.publish=false"]


def test_resolution_follows_what_torch_sees():
    cuda = torch.cuda.is_available()
    auto = resolve_compute()
    assert (auto.device.type, auto.dtype) == (("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32))
    assert resolve_compute("auto", "auto", release_dtype="float16").dtype == torch.float32  # not ours: fp32
    assert (resolve_compute("cpu").device, resolve_compute("cpu").dtype) == (torch.device("cpu"), torch.float32)
    assert resolve_compute("cpu", "bfloat16").dtype == torch.bfloat16  # an explicit dtype wins on either device
    assert resolve_compute("CPU", "Float32").dtype_name == "float32"
    for device, dtype, message in [("tpu", "auto", "engine.device='tpu': expected auto, cpu, cuda or cuda:N"),
                                   ("cuda:x", "auto", "expected auto, cpu, cuda or cuda:N"),
                                   ("cpu", "fp16", "dtype='fp16': expected auto, float32 or bfloat16")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            resolve_compute(device, dtype, what="engine.device")
    if not cuda:
        with pytest.raises(ValueError, match="engine.device='cuda': no CUDA device is visible to torch"):
            resolve_compute("cuda", what="engine.device")


def test_the_cpu_boundary_is_no_boundary(tiny_model):
    """On the CPU the engines call the model itself (no wrapper, no copies); elsewhere a DeviceForward."""
    assert on_device(tiny_model, torch.device("cpu")) is tiny_model
    wrapped = on_device(tiny_model, torch.device("meta"))
    assert isinstance(wrapped, DeviceForward) and callable(wrapped.prefill) and callable(wrapped.decode)
    assert not hasattr(on_device(lambda ids: ids, torch.device("meta")), "prefill")


def test_fresh_adapters_keep_their_cpu_bits(tiny_cfg):
    """`ResidentBase(device=cpu)` draws each placement's A factors exactly as before the device option."""
    from dsv4flash.engine.resident import ResidentBase
    from dsv4flash.lora import LoraConfig, lora_parameters

    resident = ResidentBase("tiny", device="cpu")
    assert resident.device == torch.device("cpu") and resident.compute.dtype == torch.float32
    pc = LoraConfig(preset="decoder_half", rank=2, seed=3)
    fresh = resident.fresh_adapter(pc)
    gen = torch.Generator().manual_seed(3)
    for key, p in lora_parameters(resident.shell(pc)).items():
        want = (torch.zeros_like(p) if key.endswith("lora_B.weight")
                else torch.empty_like(p).uniform_(-(1.0 / p.shape[-1]) ** 0.5, (1.0 / p.shape[-1]) ** 0.5, generator=gen))
        assert torch.equal(fresh[key], want), key
    assert resident.to_device(dict(fresh)) == dict(fresh)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: auto means CUDA here (tests/gpu)")
def test_auto_is_the_cpu_float32_run_bit_for_bit(tmp_path):
    """engine=local with the defaults (engine.device=auto, model.dtype=auto) on a machine without CUDA: the same
    adapter bits, metrics and run fingerprint as engine.device=cpu model.dtype=float32 spelt out."""
    from dsv4flash.engine import run_local
    from dsv4flash.engine.fingerprint import fingerprint
    from dsv4flash.engine.local import resolve_run

    auto = to_train_config(compose("decoder_lora", SMALL))
    explicit = to_train_config(compose("decoder_lora", SMALL + ["engine.device=cpu", "model.dtype=float32"]))
    assert (auto.engine.device, auto.model.dtype) == ("auto", "auto")
    resolved, compute = resolve_run(auto)
    assert (resolved.model.dtype, str(compute.device)) == ("float32", "cpu")
    assert fingerprint(resolved) == fingerprint(explicit)
    a, b = run_local(auto, tmp_path / "auto"), run_local(explicit, tmp_path / "explicit")
    assert a.summary["compute"] == b.summary["compute"] == {"device": "cpu", "dtype": "float32"}
    wa, wb = (load_file(r.adapter_dir / "adapter_model.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows = [[{k: v for k, v in json.loads(line).items() if k != "step_time"}
             for line in (r.output_dir / "metrics.jsonl").read_text().splitlines()] for r in (a, b)]
    assert rows[0] == rows[1] and a.summary["config_fingerprint"] == b.summary["config_fingerprint"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: device=cuda is valid here")
def test_asking_for_cuda_without_one_is_a_user_error(tmp_path, capsys):
    """One `error:` line and exit 2, from training and from the server, before any model is built."""
    import subprocess
    import sys

    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "dsv4flash.train", "+recipe=decoder_lora", *SMALL, "engine.device=cuda",
                          f"output_dir={out}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and lines[-1].startswith("error: engine.device='cuda': no CUDA device"), run.stderr
    assert "Traceback" not in run.stderr
    from dsv4flash.cli import main

    assert main(["serve", "--device", "cuda", "--store", str(tmp_path / "s"), "--base", "random-tiny"]) == 2
    assert "--device='cuda': no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()
