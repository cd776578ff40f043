"""The embedded engines on CUDA: `python -m dsv4flash.train` (engine=local) and the service's resident base train a
step in the release's bfloat16 on the device, and agree with the float32 CPU run within bfloat16 tolerance."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.gpu

SMALL = ["model.base=random", "engine.steps=1", "engine.batch_size=4", "engine.eval_every=1", "engine.log_every=1",
         "engine.checkpoint_every=0", "data.val_size=8", "engine.eval_generate=true", "engine.progress=off",
         "lora.rank=4", "lifecycle.publish=false"]


def _rows(result) -> list[dict]:
    return [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]


def test_local_engine_trains_a_step_on_cuda_like_the_cpu(tmp_path):
    from dsv4flash.engine import run_local
    from dsv4flash.train.compose import compose, to_train_config

    gpu = run_local(to_train_config(compose("decoder_lora", SMALL)), tmp_path / "cuda")  # auto: CUDA, bfloat16
    cpu = run_local(to_train_config(compose("decoder_lora", SMALL + ["engine.device=cpu"])), tmp_path / "cpu")
    assert gpu.summary["compute"]["device"].startswith("cuda") and gpu.summary["compute"]["dtype"] == "bfloat16"
    assert cpu.summary["compute"] == {"device": "cpu", "dtype": "float32"}
    g, c = _rows(gpu), _rows(cpu)
    for key in ("val_loss",):  # the untrained model's loss (step 0), then after the step
        assert g[0][key] == pytest.approx(c[0][key], rel=2e-2) and g[-1][key] == pytest.approx(c[-1][key], rel=2e-2)
    assert g[1]["loss"] == pytest.approx(c[1]["loss"], rel=2e-2)
    wg, wc = (load_file(r.adapter_dir / "adapter_model.safetensors") for r in (gpu, cpu))
    assert wg.keys() == wc.keys()
    moved = [k for k in wc if "lora_B" in k]
    dg = torch.cat([wg[k].float().reshape(-1) for k in moved])
    dc = torch.cat([wc[k].float().reshape(-1) for k in moved])
    assert float(dc.abs().max()) > 0  # it trained
    # Adam's first update is close to lr·sign(g): the same direction, up to gradients that round to near zero
    assert float(torch.nn.functional.cosine_similarity(dg, dc, dim=0)) > 0.95


def test_service_trains_and_samples_on_cuda_like_the_cpu():
    import dsv4flash.service as tinker
    from dsv4flash.service import types

    def one_step(device: str):
        service = tinker.ServiceClient(device=device)
        tc = service.create_lora_training_client(rank=2, preset="decoder_half", seed=1)
        datum = types.Datum(model_input=types.ModelInput.from_ints([0, 5, 6, 7]),
                            loss_fn_inputs=dict(target_tokens=[5, 6, 7, 8], weights=[1.0] * 4))
        first = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        sampler = tc.save_weights_and_get_sampling_client("s")
        out = sampler.sample(types.ModelInput.from_ints([0, 5, 6]), 2,
                             types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)).result()
        return service.base.compute, first, after, out

    compute, first, after, out = one_step("auto")
    assert compute.device.type == "cuda" and compute.dtype == torch.bfloat16
    _, cpu_first, cpu_after, cpu_out = one_step("cpu")
    assert first == pytest.approx(cpu_first, rel=2e-2) and after == pytest.approx(cpu_after, rel=2e-2)
    assert after < first
    assert [len(s.tokens) for s in out.sequences] == [len(s.tokens) for s in cpu_out.sequences] == [4, 4]
