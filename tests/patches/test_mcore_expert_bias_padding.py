"""DSV41-MCORE-001: padded tokens vs megatron-core's expert-bias token counts (real TopKRouter on CPU).

The stock tests show the 0.19.x bug. The `patch_form` tests run twice: with the runtime twin applied to the
installed megatron-core, and in a subprocess on a copy of the pinned release with the format-patch applied;
both must pass and record identical values.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore_cpu import models

PATCH_ID = "DSV41-MCORE-001"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]


def _router(**overrides):
    """A real megatron-core TopKRouter with expert bias (tiny config), on the current model-parallel state."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    config = models.tiny_moe_config(**overrides)
    return TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _all_to_expert0_logits(tokens: int, experts: int) -> torch.Tensor:
    """Router logits `[s, b=1, E]` that send every token to expert 0 under top-1."""
    logits = torch.zeros(tokens, 1, experts)
    logits[:, :, 0] = 5.0
    return logits


def _padding_mask(seq: int, batch: int) -> torch.Tensor:
    """`[s, b]`, True = padding: batch 0 loses its first token, batch 1 its last three."""
    mask = torch.zeros(seq, batch, dtype=torch.bool)
    mask[0, 0] = True
    mask[-3:, 1] = True
    return mask


@pytest.fixture
def stock_upstream():
    """The installed megatron-core exactly as shipped (runtime twin taken out if something applied it)."""
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    if twin.upstream_has_it():
        pytest.skip(f"installed megatron-core {twin.installed_version()} already has the fix")
    with twin.suspended():
        yield twin


def test_stock_router_raises_shape_error_with_padding(mcore_parallel, stock_upstream):
    router = _router()
    hidden = torch.randn(6, 2, router.config.hidden_size)  # [s, b, h]: 12 tokens, 4 experts
    with pytest.raises(RuntimeError, match=r"size of tensor a \(4\) must match the size of tensor b \(12\)"):
        router(hidden, padding_mask=_padding_mask(6, 2))


def test_stock_router_miscounts_silently_when_tokens_equal_experts(mcore_parallel, stock_upstream):
    router = _router(moe_router_topk=1)
    padding = torch.tensor([[False], [False], [False], [True]])  # [s=4, b=1]: token 3 is padding
    router.routing(_all_to_expert0_logits(4, 4), padding_mask=padding)
    # The [4] mask broadcast over experts masks expert 3 instead of token 3: expert 0 keeps all 4 tokens.
    assert router.local_tokens_per_expert.tolist() == [4.0, 0.0, 0.0, 0.0]


def test_stock_gpt_moe_forward_fails_with_padding(mcore_parallel, stock_upstream):
    model = models.tiny_gpt_moe()
    padding = _padding_mask(8, 2).T.contiguous()  # GPTModel takes [b, s]
    with pytest.raises(RuntimeError, match="must match the size"):
        model(**models.gpt_inputs(batch=2, seq_len=8), padding_mask=padding)


def test_router_counts_only_real_tokens(patch_form, mcore_parallel):
    router = _router()
    torch.manual_seed(3)
    hidden = torch.randn(6, 2, router.config.hidden_size)  # [s, b, h]
    padding = _padding_mask(6, 2)
    probs, routing_map = router(hidden, padding_mask=padding)  # [s*b, E] each
    valid = ~padding.reshape(-1)  # token order of routing_map: s-major, like the router's flattening
    counts = router.local_tokens_per_expert
    assert torch.equal(counts, routing_map[valid].sum(dim=0).float())
    assert counts.sum().item() == router.topk * valid.sum().item()
    patch_form.record("counts", counts)
    patch_form.record("routing_map", routing_map)
    patch_form.record("probs", probs, atol=1e-6)


def test_tokens_equal_experts_counts_tokens_not_experts(patch_form, mcore_parallel):
    router = _router(moe_router_topk=1)
    padding = torch.tensor([[False], [False], [False], [True]])
    router.routing(_all_to_expert0_logits(4, 4), padding_mask=padding)
    assert router.local_tokens_per_expert.tolist() == [3.0, 0.0, 0.0, 0.0]
    patch_form.record("counts", router.local_tokens_per_expert)


def test_without_padding_and_without_grad_behaviour_is_unchanged(patch_form, mcore_parallel):
    router = _router()
    torch.manual_seed(4)
    hidden = torch.randn(5, 2, router.config.hidden_size)
    _, routing_map = router(hidden)
    assert torch.equal(router.local_tokens_per_expert, routing_map.sum(dim=0).float())
    with torch.no_grad():  # evaluation / the no-grad checkpoint forward must not count
        router(hidden, padding_mask=_padding_mask(5, 2))
    assert torch.equal(router.local_tokens_per_expert, routing_map.sum(dim=0).float())
    patch_form.record("counts", router.local_tokens_per_expert)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_padded_gpt_moe_batch_updates_bias_from_real_tokens(patch_form, mcore_parallel, dispatcher):
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(5)
    model_parallel_cuda_manual_seed(5, force_reset_rng=True)
    config = models.tiny_moe_config(moe_token_dispatcher_type=dispatcher, moe_router_bias_update_rate=1e-3)
    model = models.tiny_gpt_moe(config)
    routers = [layer.mlp.router for layer in model.decoder.layers]
    routing_maps = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: routing_maps.append(out[1].detach())) for r in routers]
    padding = _padding_mask(8, 2).T.contiguous()  # [b, s], True = padding
    logits = model(**models.gpt_inputs(batch=2, seq_len=8), padding_mask=padding)  # [b, s, vocab]
    logits.float().pow(2).mean().backward()
    for hook in hooks:
        hook.remove()
    valid = ~padding.T.reshape(-1)  # MoELayer routes in [s, b] order
    expected = [rm[valid].sum(dim=0).float() for rm in routing_maps]
    for router, counts in zip(routers, expected):
        assert torch.equal(router.local_tokens_per_expert, counts)
        assert counts.sum().item() == config.moe_router_topk * valid.sum().item()
    _update_router_expert_bias([model], config)
    for router, counts in zip(routers, expected):
        offset = counts.mean() - counts
        torch.testing.assert_close(router.expert_bias, torch.sign(offset) * config.moe_router_bias_update_rate)
    patch_form.record("counts", torch.stack(expected))
    patch_form.record("expert_bias", torch.stack([r.expert_bias for r in routers]), atol=1e-9)
    patch_form.record("logits", logits, atol=1e-5, rtol=1e-5)


_COMPILED_TWIN = """
import sys, torch
import tests  # the repository's tests/ (namespace), not the verl wheel's package
tests.__path__ = [sys.argv[1]]
from tests.mcore_cpu import models, parallel
from dsv4flash.patching import twins
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter

twin = twins.discover().get("DSV41-MCORE-001")
with parallel.model_parallel():
    assert twin.apply() is twins.Outcome.APPLIED
    assert hasattr(TopKRouter.__dict__["_apply_expert_bias"], "_torchdynamo_orig_callable"), "not compiled"
    router = TopKRouter(models.tiny_moe_config(), pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    padding = torch.zeros(6, 2, dtype=torch.bool)
    padding[-2:, 1] = True
    _, routing_map = router(torch.randn(6, 2, 32), padding_mask=padding)
    assert torch.equal(router.local_tokens_per_expert, routing_map[~padding.reshape(-1)].sum(0).float())
print("compiled twin ok")
"""


@pytest.mark.slow
def test_twin_works_under_megatron_jit_fuser_compile():
    """GPU users run megatron's jit_fuser (torch.compile); the twin is wrapped the same way and must compile."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHDYNAMO_DISABLE", "TORCH_COMPILE_DISABLE")}
    proc = subprocess.run([sys.executable, "-c", _COMPILED_TWIN, str(root / "tests")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "compiled twin ok" in proc.stdout, proc.stderr[-3000:]
