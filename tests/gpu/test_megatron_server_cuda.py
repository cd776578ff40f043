"""`dsv4flash serve --trainer megatron` at tiny size on CUDA: the real tinker SDK trains through veRL's Megatron
worker group on the GPU (bf16, one rank) and samples on the dsv4flash replica; the losses follow the local
trainer's on the CPU within bf16 tolerance, and the group's peak device memory is flat from 1 to 4 policies."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

KEY = "tml-gpu-check-0123456789"


def _datum(mod, tokens, prompt_len):
    weights = np.array([0] * prompt_len + [1] * (len(tokens) - prompt_len), dtype=np.float32)[1:]
    return mod.Datum(model_input=mod.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs=dict(weights=weights, target_tokens=np.array(tokens[1:], dtype=np.int64)))


def _device_peak(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", headers={"X-API-Key": KEY}, timeout=120).text.splitlines():
        if line.startswith("dsv4flash_trainer_device_peak_bytes "):
            return float(line.split()[1])
    raise AssertionError("no dsv4flash_trainer_device_peak_bytes in /metrics")


def test_megatron_trainer_server_on_cuda(tmp_path):
    import tinker
    from tinker import types

    import dsv4flash.service as core
    from dsv4flash.service.protocol.launch import ServerProcess

    (tmp_path / "keys").write_text(f"gpu {KEY}\n")
    rows = [([0, 10, 11, 12, 20, 21, 22, 1], 4), ([0, 13, 14, 15, 23, 24, 25, 1], 4)]
    args = ("--trainer", "megatron", "--trainer-layout", "ep=1", "--sampler", "dsv4flash")
    with ServerProcess(tmp_path / "store", tmp_path / "keys", args=args, start_timeout_s=900) as server:
        assert "CUDA bf16" in server.log()
        sdk = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sdk.create_lora_training_client(base_model="tiny", rank=8, train_mlp=False).result()
        local = core.ServiceClient(root=tmp_path / "local", device="cpu").create_lora_training_client(
            base_model="tiny", preset="decoder_half", rank=8, train_mlp=False)
        data, local_data = [_datum(types, *r) for r in rows], [_datum(core.types, *r) for r in rows]
        for step in range(3):
            got = tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
            want = local.forward_backward(local_data, "cross_entropy").result().metrics["loss:sum"]
            assert got == pytest.approx(want, rel=3e-2), f"step {step}"
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            local.optim_step(core.types.AdamParams(learning_rate=1e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints([0, 10, 11]), 2, types.SamplingParams(max_tokens=4, seed=1)
                             ).result()
        assert len(out.sequences) == 2 and all(np.isfinite(s.logprobs).all() for s in out.sequences)
        one = _device_peak(server.url)
        for seed in (1, 2, 3):
            other = sdk.create_lora_training_client(base_model="tiny", rank=16, seed=seed).result()
            other.forward_backward(data, "cross_entropy").result()
            other.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            tc.forward_backward(data, "cross_entropy").result()  # swaps back and forth
        four = _device_peak(server.url)
        assert 0 < four <= one * 1.05, (one, four)  # slots live in host memory: the device holds one policy
