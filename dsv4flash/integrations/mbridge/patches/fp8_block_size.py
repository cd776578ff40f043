"""Runtime twin of DSV41-MBRIDGE-002: FP8 weight/scale pairs with a block size; MXFP4 keeps the sign of zero.

Why: megatron-bridge 0.6.2's `maybe_dequantize_hf_quantized_weight` and `requantize_hf_weight_scale_pairs`
hard-code 128-wide FP8 blocks. A checkpoint quantized in 32×32 blocks (V4.1's dense FP8 weights) cannot be
re-exported, and imports without an error but wrongly: `dequantize_fp8_e4m3fn_with_scale` repeats the
[ceil(M/32), ceil(N/32)] scale grid 128 times per axis and crops it, so every block but the first gets the
wrong scale. `quantize_mxfp4_e2m1_like_scale` sets the sign nibble with `normalized < 0`, so a decoded -0.0
re-exports as +0 and an unchanged MXFP4 checkpoint does not re-export to its bytes.

How: `block_size` (default 128) on both entry points, forwarded to the existing block-size parameters;
`dequantize_fp8_e4m3fn_with_scale` refuses a row-block or 2-D block scale grid that is not one entry per
block; the MXFP4 quantizer's sign nibble comes from `torch.signbit` (the stock quantizer, then the sign
bit of every value OR-ed into its nibble: identical for every value but -0.0). Everything else is stock.
"""

from __future__ import annotations

import inspect

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.mbridge.patches import import_bridge, mbridge_twin

_QU = "megatron.bridge.models.conversion.quantization_utils"
TOUCHES = tuple(f"{_QU}.{name}" for name in (
    "maybe_dequantize_hf_quantized_weight", "requantize_hf_weight_scale_pairs", "dequantize_fp8_e4m3fn_with_scale",
    "quantize_mxfp4_e2m1_like_scale"))


def upstream_has_block_size() -> bool:
    """Probe: do both entry points take `block_size`, and does -0.0 keep its MXFP4 sign nibble?"""
    import_bridge()
    from megatron.bridge.models.conversion import quantization_utils as qu

    if not all("block_size" in inspect.signature(fn).parameters
               for fn in (qu.maybe_dequantize_hf_quantized_weight, qu.requantize_hf_weight_scale_pairs)):
        return False
    zero = torch.tensor([[-0.0] + [1.0] * 31])
    packed, _ = qu.quantize_mxfp4_e2m1_like_scale(zero, torch.ones(1, 1))
    return int(packed.view(torch.uint8)[0, 0]) & 0x8 == 0x8


def _patched(qu, stock_dequantize, stock_mxfp4):
    """The four replacements, closing over the stock functions they extend."""

    def dequantize_fp8_e4m3fn_with_scale(weight, scale, *, name="", block_size=qu.FP8_BLOCK_SIZE,
                                         dtype=torch.bfloat16):
        """Stock decode, after checking a row-block / 2-D block scale grid against `block_size`."""
        rows, cols = weight.shape[0], weight.shape[-1]
        grid = None
        if scale.dim() == 1 and scale.shape[0] != rows:
            grid = (-(-rows // block_size),)
        elif scale.dim() == 2 and scale.shape[0] != rows:
            grid = (-(-rows // block_size), -(-cols // block_size))
        if grid is not None and tuple(scale.shape) != grid:
            label = f" for {name!r}" if name else ""
            raise RuntimeError(f"FP8 scale grid mismatch{label}: weight={tuple(weight.shape)} "
                               f"scale={tuple(scale.shape)}, block_size={block_size} needs scale={grid}; "
                               "pass the checkpoint's block_size")
        return stock_dequantize(weight, scale, name=name, block_size=block_size, dtype=dtype)

    def maybe_dequantize_hf_quantized_weight(hf_param, hf_state_dict, *, dtype=torch.bfloat16,
                                             block_size=qu.FP8_BLOCK_SIZE):
        """Load and dequantize HF `*.weight` tensors with sibling `*.scale`s, FP8 in `block_size` blocks."""
        if isinstance(hf_param, dict):
            return {k: maybe_dequantize_hf_quantized_weight(v, hf_state_dict, dtype=dtype, block_size=block_size)
                    for k, v in hf_param.items()}
        weight = hf_state_dict[hf_param]
        scale_key = hf_param[: -len(".weight")] + ".scale" if hf_param.endswith(".weight") else None
        if weight.dtype == torch.int8:
            if scale_key is None or scale_key not in hf_state_dict:
                return weight.to(dtype)
            return qu.dequantize_mxfp4_e2m1_packed(weight, hf_state_dict[scale_key], dtype=dtype)
        if weight.dtype != torch.float8_e4m3fn:
            return weight
        if scale_key is None or scale_key not in hf_state_dict:
            return weight.to(dtype)
        return qu.dequantize_fp8_e4m3fn_with_scale(weight, hf_state_dict[scale_key], name=hf_param,
                                                   block_size=block_size, dtype=dtype)

    def requantize_hf_weight_scale_pairs(converted_weights_dict, hf_state_dict, *, use_mxfp4=None,
                                         block_size=qu.FP8_BLOCK_SIZE):
        """Recreate quantized `*.weight`/`*.scale` pairs in the source scale layout (FP8 in `block_size`)."""
        result = {}
        for hf_param, weight in converted_weights_dict.items():
            if not hf_param.endswith(".weight"):
                if hf_param.endswith(".scale") and hf_param[: -len(".scale")] + ".weight" in converted_weights_dict:
                    continue
                result[hf_param] = weight
                continue
            scale_key = hf_param[: -len(".weight")] + ".scale"
            if scale_key not in hf_state_dict:
                result[hf_param] = weight
                continue
            source_scale = hf_state_dict[scale_key]
            if use_mxfp4 is not None and use_mxfp4(hf_param, weight, source_scale):
                q_weight, q_scale = qu.quantize_mxfp4_e2m1_like_scale(weight, source_scale, name=hf_param)
            else:
                q_weight, q_scale = qu.quantize_fp8_e4m3fn_like_scale(weight, source_scale, name=hf_param,
                                                                      block_size=block_size)
            result[hf_param] = q_weight
            result[scale_key] = q_scale
        return result

    def quantize_mxfp4_e2m1_like_scale(weight, source_scale, *, name="", block_size=qu.MXFP4_BLOCK_SIZE):
        """Stock MXFP4 quantizer, with every value's sign bit in its nibble (so -0.0 stays -0)."""
        packed, scale = stock_mxfp4(weight, source_scale, name=name, block_size=block_size)
        sign = torch.signbit(weight).to(torch.uint8).reshape(weight.shape[0], -1, 2)  # [rows, cols/2, (lo, hi)]
        return (packed.view(torch.uint8) | (sign[..., 0] << 3) | (sign[..., 1] << 7)).view(torch.int8), scale

    return (dequantize_fp8_e4m3fn_with_scale, maybe_dequantize_hf_quantized_weight,
            requantize_hf_weight_scale_pairs, quantize_mxfp4_e2m1_like_scale)


@mbridge_twin(
    patch_id="DSV41-MBRIDGE-002",
    touches=TOUCHES,
    gate="DSV4FLASH_MBRIDGE_FP8_BLOCK_SIZE",
    tests=("tests/patches/test_mbridge_fp8_block_size.py",),
    upstream_has_it=upstream_has_block_size,
)
def install(patcher: Patcher) -> None:
    """Replace the four functions on megatron-bridge's `quantization_utils` module."""
    from megatron.bridge.models.conversion import quantization_utils as qu

    for fn in _patched(qu, qu.dequantize_fp8_e4m3fn_with_scale, qu.quantize_mxfp4_e2m1_like_scale):
        patcher.replace(qu, fn.__name__, fn)
