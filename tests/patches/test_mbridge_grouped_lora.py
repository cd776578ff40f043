"""DSV41-MBRIDGE-004: Megatron-Bridge's LoRA on megatron-core's grouped low-rank projection (CSA2 `wo_a`).

The stock test shows 0.6.2's `LoRA` refuses the projection ("Layer type is unrecognized for LoRA"). The
`patch_form` tests run with the runtime twin on the installed megatron-bridge and on a copy of the pinned release
with the format-patch applied; megatron-core's `GroupedLowRankProjection` comes from the DSV41-MCORE-008 twin in
the runtime form (stock megatron-core has none) and, in the series form, from the pinned megatron-core with the
megatron-lm series applied up to DSV41-MCORE-008 (the patch's `Depends-On: megatron-lm/DSV41-MCORE-008`). The oracles: a per-group computation in plain PyTorch, and the real `peft`
library loading the exported rank-G·r adapter on the base weight. The in-patch unit test runs on the patched tree
in tests/patches/test_mbridge_upstream_unit_tests.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from dsv4flash.patchseries.testing import FORM_ENV

PATCH_ID = "DSV41-MBRIDGE-004"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
if importlib.util.find_spec("megatron.bridge") is None:  # not imported here: it needs the CPU shim first
    pytest.skip("megatron-bridge is not installed", allow_module_level=True)

GROUPS, HEADS, HEAD_DIM, OUT_RANK, DIM, ALPHA = 4, 8, 3, 5, 2, 6
IN_G = HEADS // GROUPS * HEAD_DIM


@pytest.fixture(scope="module")
def lora_cls():
    """megatron-bridge's `LoRA` (CPU import shim), with megatron-core's CSA2 modules: the DSV41-MCORE-008 twin on a
    stock megatron-core; in the series form the patched megatron-core the harness puts on the path (the patch's
    `Depends-On: megatron-lm/DSV41-MCORE-008`), where the twin's probe finds them."""
    from dsv4flash.patching import twins
    from tests.mbridge import shim

    shim.install()
    csa2 = twins.discover().get("DSV41-MCORE-008")
    applied_here = not csa2.applied
    outcome = csa2.apply(mode="auto")
    assert outcome.active, outcome
    if os.environ.get(FORM_ENV) == "series":  # the patched megatron-core tree is on the path, not the twin
        assert outcome is twins.Outcome.UPSTREAM_HAS_IT, outcome
    from megatron.bridge.peft.lora import LoRA

    yield LoRA
    if applied_here:
        for twin in reversed(twins.REGISTRY.all()):
            if twin.applied and twin.meta.distribution == "megatron-core":
                twin.revert()


def _model(seed: int = 0) -> nn.Module:
    """An attention stand-in holding megatron-core's real grouped projection next to a plain linear."""
    from megatron.core.transformer.experimental_attention_variant.csa2 import (
        CSA2TransformerConfig,
        GroupedLowRankProjection,
    )

    torch.manual_seed(seed)
    config = CSA2TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=HEADS, kv_channels=HEAD_DIM, ffn_hidden_size=32,
        add_bias_linear=False, params_dtype=torch.float32, use_cpu_initialization=True, init_method_std=0.2,
        hc_mult=1, csa2_layer_pattern="S", csa2_compress_ratios=[0], csa2_q_lora_rank=8, csa2_rope_dim=2,
        csa2_sliding_window=4, csa2_output_groups=GROUPS, csa2_output_rank=OUT_RANK)
    attention = nn.Module()
    attention.linear_o_group_proj = GroupedLowRankProjection(config, IN_G)
    attention.linear_proj = nn.Linear(GROUPS * OUT_RANK, 16, bias=False)
    model = nn.Module()
    model.self_attention = attention
    return model


def _adapted(lora_cls, seed: int = 0):
    model = lora_cls(target_modules=["linear_o_group_proj"], dim=DIM, alpha=ALPHA)(_model(seed), training=True)
    wrapped = model.self_attention.linear_o_group_proj
    with torch.no_grad():  # a trained-looking adapter (B starts at zero)
        wrapped.adapter.lora_B.copy_(torch.randn(wrapped.adapter.lora_B.shape,
                                                 generator=torch.Generator().manual_seed(seed + 1)))
    return model, wrapped


def test_stock_release_refuses_the_grouped_projection(lora_cls):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-bridge {twin.installed_version()} already has {PATCH_ID}")
        with pytest.raises(NotImplementedError, match="Layer type is unrecognized for LoRA.*GroupedLowRankProjection"):
            lora_cls(target_modules=["linear_o_group_proj"], dim=DIM, alpha=ALPHA)(_model(), training=True)


def test_twin_executes_the_patchs_own_file():
    from dsv4flash.integrations.mbridge.patches.grouped_lora import SOURCE, UPSTREAM_SOURCES
    from dsv4flash.patchseries.series import load_series

    patch = load_series(ROOT / "patches")["megatron-bridge"].by_id()[PATCH_ID]
    hunk = patch.diff.split(f"--- /dev/null\n+++ b/{SOURCE}\n", 1)[1].split("\ndiff --git", 1)[0]
    added = "".join(line[1:] + "\n" for line in hunk.splitlines()[1:] if line.startswith("+"))
    assert added == (UPSTREAM_SOURCES / SOURCE).read_text(), f"{SOURCE}: the twin's copy differs from the patch"


def test_lora_adapts_each_group_like_a_per_group_computation(patch_form, lora_cls):
    model, wrapped = _adapted(lora_cls)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == ["self_attention.linear_o_group_proj.adapter.lora_A",
                         "self_attention.linear_o_group_proj.adapter.lora_B"]
    o = torch.randn(2, 3, GROUPS, IN_G, generator=torch.Generator().manual_seed(7), requires_grad=True)
    out = wrapped(o)  # [b, s, G·out]
    w = wrapped.to_wrap.weight.detach().view(GROUPS, OUT_RANK, IN_G)
    a, b = wrapped.adapter.lora_A.detach(), wrapped.adapter.lora_B.detach()
    want = torch.cat([o[:, :, g].detach() @ (w[g] + ALPHA / DIM * b[g] @ a[g]).T for g in range(GROUPS)], dim=-1)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    assert wrapped.to_wrap.weight.grad is None
    moved = o.detach().clone()
    moved[:, :, 1] += 1.0  # group 1's input reaches group 1's output only
    delta = (wrapped(moved) - out).detach().view(2, 3, GROUPS, OUT_RANK)
    assert torch.equal(delta[:, :, [0, 2, 3]], torch.zeros_like(delta[:, :, [0, 2, 3]]))
    patch_form.record("init_lora_A", a, atol=1e-6)
    patch_form.record("output", out.detach(), atol=1e-5)
    patch_form.record("grad_lora_A", wrapped.adapter.lora_A.grad, atol=1e-4, rtol=1e-5)
    patch_form.record("grad_lora_B", wrapped.adapter.lora_B.grad, atol=1e-4, rtol=1e-5)


def test_peft_export_loads_in_peft_with_the_same_update(patch_form, lora_cls):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    _, wrapped = _adapted(lora_cls, seed=3)
    export = wrapped.peft_weights()
    assert export["r"] == GROUPS * DIM and export["lora_alpha"] == GROUPS * ALPHA
    # The HF form of the projection: one linear [G·out, in_g] whose group g reads rows g·out … (g+1)·out − 1.
    base = nn.Module()
    base.wo_a = nn.Linear(IN_G, GROUPS * OUT_RANK, bias=False)
    base.wo_a.weight.data.copy_(wrapped.to_wrap.weight.detach())
    peft_model = get_peft_model(base, LoraConfig(r=export["r"], lora_alpha=export["lora_alpha"],
                                                 target_modules=["wo_a"], init_lora_weights=False))
    result = set_peft_model_state_dict(peft_model, {"base_model.model.wo_a.lora_A.weight": export["lora_A.weight"],
                                                    "base_model.model.wo_a.lora_B.weight": export["lora_B.weight"]})
    assert not result.unexpected_keys
    o = torch.randn(2, 3, GROUPS, IN_G, generator=torch.Generator().manual_seed(11))
    every = peft_model.base_model.model.wo_a(o).view(2, 3, GROUPS, GROUPS, OUT_RANK)  # group g through all rows
    peft_out = torch.stack([every[:, :, g, g] for g in range(GROUPS)], dim=2).flatten(-2)
    torch.testing.assert_close(peft_out, wrapped(o).detach())
    merged = peft_model.merge_and_unload().wo_a.weight.detach()
    torch.testing.assert_close(merged, wrapped.weight.detach())
    patch_form.record("peft_lora_B", export["lora_B.weight"], atol=1e-6)
    patch_form.record("merged_weight", merged, atol=1e-5)


def test_existing_targets_keep_their_adapters(patch_form, lora_cls):
    from megatron.bridge.peft.lora_layers import LinearAdapter

    model = lora_cls(target_modules=["linear_o_group_proj", "linear_proj"], dim=DIM, alpha=ALPHA)(
        _model(), training=True)
    assert isinstance(model.self_attention.linear_proj, LinearAdapter)
    names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    patch_form.record("trainable", names)
