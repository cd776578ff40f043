"""Unmerged adapter export over 2 expert-parallel gloo ranks: every rank streams every expert's LoRA factors
(Megatron-Bridge alone gives each rank only its local experts'), equal to a single-rank export of the same model."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.upstream, pytest.mark.whole_machine]
TARGETS = ["*.layers.2.mlp.experts.*linear_fc1", "*.layers.2.mlp.experts.*linear_fc2", "*.layers.2.self_attention.linear_q_up"]


def _export(release: str, out: str, rank: int, ep: int) -> None:
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state

    from dsv4flash.integrations import mbridge

    provider = mbridge.provider_for(release)
    model = provider.provide()
    model = mbridge.DSV41LoRA(target_modules=TARGETS, dim=2, alpha=4)(model, training=False)
    # Seeded by global name, so the 1-rank and the 2-rank models hold the same factors.
    first = parallel_state.get_expert_model_parallel_rank() * (provider.dsv4.text.n_routed_experts // ep)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".adapter." in name:
                glob = name
                if ".local_experts." in name:
                    head, tail = name.split(".local_experts.")
                    idx, rest = tail.split(".", 1)
                    glob = f"{head}.local_experts.{int(idx) + first}.{rest}"
                gen = torch.Generator().manual_seed(sum(map(ord, glob)))
                p.copy_(torch.randn(p.shape, generator=gen))
    auto = AutoBridge(mbridge.ReleasePretrained(release))
    adapters = {n: w.tolist() for n, w in auto.export_adapter_weights([model], show_progress=False)}
    with open(f"{out}/ep{ep}_rank{rank}.json", "w") as f:
        json.dump(adapters, f)


def _rank(rank: int, world_size: int, release: str, out: str) -> None:
    from tests.mbridge import shim

    shim.install()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsv4flash.integrations import mbridge

    torch.set_num_threads(1)
    mbridge.register()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        _export(release, out, rank, world_size)
    finally:
        parallel_state.destroy_model_parallel()


def test_every_ep_rank_exports_every_expert_adapter(tmp_path):
    from dsv4flash_bridge.synthetic import write_release_checkpoint
    from tests.mcore_cpu import parallel

    release = write_release_checkpoint(tmp_path / "release", "tiny", shards=1, seed=2)
    parallel.spawn_gloo(_rank, 1, str(release), str(tmp_path), timeout=600)
    parallel.spawn_gloo(_rank, 2, str(release), str(tmp_path), timeout=600)
    single = json.loads((tmp_path / "ep1_rank0.json").read_text())
    experts = {n for n in single if ".ffn.experts." in n}
    assert len(experts) == 8 * 2 * 3  # 8 experts x (A, B) x (w1, w2, w3)
    for rank in range(2):
        got = json.loads((tmp_path / f"ep2_rank{rank}.json").read_text())
        assert got.keys() == single.keys(), sorted(set(single) ^ set(got))[:6]
        for name in single:
            assert torch.equal(torch.tensor(got[name]), torch.tensor(single[name])), (rank, name)
