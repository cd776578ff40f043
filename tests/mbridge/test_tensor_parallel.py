"""`DSV41Bridge` over 2 tensor-parallel gloo ranks: Megatron-Bridge scatters each release tensor to the
layout the name table gives it (each rank's shard equals the plugin loader's), the grouped `wo_a` adapters'
groups are gathered on export, and the merged release export is byte-identical on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4flash_bridge.synthetic import write_release_checkpoint

pytestmark = [pytest.mark.upstream, pytest.mark.whole_machine]


def _rank(rank: int, world_size: int, release: str, out: str) -> None:
    """One rank: load through AutoBridge, compare with the plugin's own sharded loader, adapt, export."""
    from tests.mbridge import shim

    shim.install()
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsv4flash.integrations import mbridge
    from dsv4flash.integrations.mcore.csa2 import load_reference_state
    from tests.mbridge.test_bridge import decoded

    torch.set_num_threads(1)
    mbridge.register()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
        auto = AutoBridge(mbridge.ReleasePretrained(release))
        model = mbridge.provider_for(release).provide()
        auto.load_hf_weights([model])
        oracle = mbridge.provider_for(release).provide()
        load_reference_state(oracle, decoded(Path(release)), tp_rank=rank, tp_size=world_size)
        want = oracle.state_dict()
        for name, value in model.state_dict().items():
            if not name.endswith("._extra_state"):
                assert torch.equal(value, want[name]), f"rank {rank}: {name}"
        model = mbridge.DSV41LoRA(target_modules=["linear_o_group_proj"], dim=2, alpha=4)(model, training=False)
        wrapper = model.decoder.layers[0].self_attention.linear_o_group_proj
        groups = wrapper.to_wrap.local_groups
        full_b = torch.randn(groups * world_size, *wrapper.adapter.lora_B.shape[1:],
                             generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            wrapper.adapter.lora_B.copy_(full_b[rank * groups:(rank + 1) * groups])
        adapters = dict(auto.export_adapter_weights([model], show_progress=False))
        assert torch.equal(adapters["layers.0.attn.wo_a.lora_B.weight"], full_b)  # groups gathered over ranks
        assert adapters["layers.0.attn.wo_a.lora_A.weight"].shape[0] == groups * world_size
        mbridge.save_release(auto.export_hf_weights([model], show_progress=False), release, f"{out}/rank{rank}")
    finally:
        parallel_state.destroy_model_parallel()


def test_two_tensor_parallel_ranks(tmp_path):
    from tests.mcore_cpu import parallel

    release = write_release_checkpoint(tmp_path / "release", "tiny", shards=2, seed=9)
    parallel.spawn_gloo(_rank, 2, str(release), str(tmp_path), timeout=600)
    from dsv4flash_bridge.sharded import CheckpointReader

    for path in sorted(release.iterdir()):
        assert (tmp_path / "rank0" / path.name).read_bytes() == (tmp_path / "rank1" / path.name).read_bytes()
    with CheckpointReader(release) as before, CheckpointReader(tmp_path / "rank0") as after:
        changed = {n for n in before.names()
                   if not torch.equal(before.read(n).view(torch.uint8), after.read(n).view(torch.uint8))}
    assert "layers.0.attn.wo_a.weight" in changed and changed <= {"layers.0.attn.wo_a.weight", "layers.0.attn.wo_a.scale"}
