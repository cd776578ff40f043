"""DSV41-MBRIDGE-002: megatron-bridge's HF weight/scale helpers with a 32 FP8 block size, and MXFP4's -0.

The stock test shows 0.6.2 decodes a 32×32-block checkpoint wrongly without an error. The `patch_form` tests
run twice: with the runtime twin on the installed megatron-bridge, and in a subprocess on a copy of the pinned
release with the format-patch applied; both must pass and record identical values. The V4.1 release codecs
(`dsv4flash_bridge.codecs`) are the oracle for what a 32×32 FP8 / 1×32 MXFP4 tensor means.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dsv4flash.release.quant_plan import QuantRole
from dsv4flash_bridge import codecs

PATCH_ID = "DSV41-MBRIDGE-002"
pytestmark = [pytest.mark.patches, pytest.mark.upstream]
if importlib.util.find_spec("megatron.bridge") is None:  # not imported here: it needs the CPU shim first
    pytest.skip("megatron-bridge is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def qu():
    """megatron-bridge's quantization_utils (imported through the CPU import shim)."""
    from tests.mbridge import shim

    shim.install()
    from megatron.bridge.models.conversion import quantization_utils

    return quantization_utils


def dense(rows: int, cols: int, seed: int = 0):
    """A V4.1 dense FP8 weight (32×32 blocks, E8M0 scales) and its exact decode by the release codec."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    w[32:] *= 16  # the 32-row block rows get different scales
    q, s = codecs.encode_dense_fp8(w)
    return q, s, codecs.decode(QuantRole.DENSE_FP8, q, s)


def test_stock_release_decodes_32_blocks_wrongly_and_silently(qu):
    from dsv4flash.patching import twins

    twin = twins.discover().get(PATCH_ID)
    q, s, want = dense(64, 96)
    with twin.suspended():
        if twin.upstream_has_it():
            pytest.skip(f"installed megatron-bridge {twin.installed_version()} already has {PATCH_ID}")
        got = qu.maybe_dequantize_hf_quantized_weight("l.weight", {"l.weight": q, "l.scale": s}, dtype=torch.float32)
    assert got.shape == want.shape and (got - want).abs().max() > 1.0


@pytest.mark.parametrize("shape", [(64, 96), (70, 45)])
def test_32_block_import_equals_the_release_codec(patch_form, qu, shape):
    q, s, want = dense(*shape)
    state = {"l.weight": q, "l.scale": s}
    got = qu.maybe_dequantize_hf_quantized_weight("l.weight", state, dtype=torch.float32, block_size=32)
    assert torch.equal(got, want)
    pair = qu.maybe_dequantize_hf_quantized_weight({"gate": "l.weight"}, state, dtype=torch.float32, block_size=32)
    assert torch.equal(pair["gate"], want)
    patch_form.record("decoded", got)


def test_a_scale_grid_for_another_block_size_is_refused(patch_form, qu):
    q, s, _ = dense(64, 96)
    wrong = r"FP8 scale grid mismatch for 'l.weight'.*block_size=128 needs scale=\(1, 1\)"
    with pytest.raises(RuntimeError, match=wrong):
        qu.maybe_dequantize_hf_quantized_weight("l.weight", {"l.weight": q, "l.scale": s}, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="FP8 scale grid mismatch"):
        qu.dequantize_fp8_e4m3fn_with_scale(q, torch.ones(2), block_size=128)  # 1-D row blocks of 32
    patch_form.record("row_blocks_32", qu.dequantize_fp8_e4m3fn_with_scale(q, torch.ones(2), block_size=32,
                                                                          dtype=torch.float32))


def test_32_block_export_reproduces_the_values(patch_form, qu):
    q, s, want = dense(70, 45)
    out = qu.requantize_hf_weight_scale_pairs({"l.weight": want}, {"l.scale": s}, block_size=32)
    again = codecs.decode(QuantRole.DENSE_FP8, out["l.weight"], out["l.scale"])
    assert torch.equal(again, want)
    patch_form.record("weight_bytes", out["l.weight"].view(torch.uint8))
    patch_form.record("scale_bytes", out["l.scale"].view(torch.uint8))


def test_mxfp4_import_equals_the_release_codec_and_export_keeps_negative_zero(patch_form, qu):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    w[:, ::7] *= 1e-3  # small negatives round to -0
    q, s = codecs.encode_mxfp4(w)
    want = codecs.decode(QuantRole.EXPERT_MXFP4, q, s)
    got = qu.maybe_dequantize_hf_quantized_weight("e.weight", {"e.weight": q, "e.scale": s}, dtype=torch.float32,
                                                  block_size=32)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert bool((torch.signbit(want) & (want == 0)).any())  # the -0 case is exercised
    out = qu.requantize_hf_weight_scale_pairs(
        {"e.weight": got}, {"e.scale": s}, block_size=32,
        use_mxfp4=lambda name, weight, scale: qu.is_mxfp4_e2m1_scale_geometry(weight, scale))
    again = codecs.decode(QuantRole.EXPERT_MXFP4, out["e.weight"], out["e.scale"])
    assert torch.equal(again, want) and torch.equal(torch.signbit(again), torch.signbit(want))
    patch_form.record("mxfp4_bytes", out["e.weight"].view(torch.uint8))
