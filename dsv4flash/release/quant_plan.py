"""Quantization plan of the release layout: which tensor is stored how (docs/architecture.md §9).

Three stored layouts sit under one `quantization_config`; everything else is BF16, except the fp32 mHC
parameters, attention sinks and gate biases. The census, the bridge and the lifecycle's base fingerprint
all read this table; nobody else decides a stored dtype.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

__all__ = ["QuantRole", "StoredTensor", "quant_role", "stored_layout", "scale_name", "ROLE_PATTERNS"]


class QuantRole(str, enum.Enum):
    """How a release tensor is stored on disk."""

    DENSE_FP8 = "dense_fp8"  # F8_E4M3 with F8_E8M0 scales over 32×32 blocks
    EXPERT_MXFP4 = "expert_mxfp4"  # two E2M1 per I8 byte (low nibble = even column), 1×32 E8M0 scales
    ENGRAM_FP8 = "engram_fp8"  # F8_E4M3 table rows with per-row 1×32 E8M0 scales
    BF16 = "bf16"
    F32 = "f32"


_BLOCK = r"(?:layers|mtp)\.\d+\."
# Ordered: first match wins. Patterns are over release names (no `model.` prefix).
ROLE_PATTERNS: tuple[tuple[re.Pattern[str], QuantRole], ...] = tuple(
    (re.compile(p), role)
    for p, role in (
        (_BLOCK + r"ffn\.experts\.\d+\.w[123]\.weight", QuantRole.EXPERT_MXFP4),
        (_BLOCK + r"attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)\.weight", QuantRole.DENSE_FP8),
        (_BLOCK + r"attn\.indexer\.wq_b\.weight", QuantRole.DENSE_FP8),
        (_BLOCK + r"ffn\.shared_experts\.w[123]\.weight", QuantRole.DENSE_FP8),
        (_BLOCK + r"engram\.wkv\.weight", QuantRole.DENSE_FP8),
        (r"mtp\.\d+\.main_proj\.weight", QuantRole.DENSE_FP8),
        (_BLOCK + r"engram\.embed\.weight", QuantRole.ENGRAM_FP8),
        (_BLOCK + r"attn\.attn_sink", QuantRole.F32),
        (_BLOCK + r"hc_(?:attn|ffn)_(?:fn|base|scale)", QuantRole.F32),
        (_BLOCK + r"ffn\.gate\.bias(?:_vl)?", QuantRole.F32),
    )
)


def quant_role(name: str) -> QuantRole:
    """The stored role of a release tensor name (BF16 when no rule matches)."""
    for pattern, role in ROLE_PATTERNS:
        if pattern.fullmatch(name):
            return role
    return QuantRole.BF16


def scale_name(name: str) -> str:
    """`<stem>.weight` -> `<stem>.scale`: the release's sibling scale tensor."""
    if not name.endswith(".weight"):
        raise ValueError(f"{name}: only `.weight` tensors have a `.scale` sibling")
    return name[: -len(".weight")] + ".scale"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as it sits in a release shard: name, safetensors dtype string and on-disk shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on disk."""
        return math.prod(self.shape) * (4 if self.dtype == "F32" else 2 if self.dtype == "BF16" else 1)


def stored_layout(name: str, logical_shape: tuple[int, ...]) -> list[StoredTensor]:
    """The on-disk tensors (weight, then scale if any) for one logical parameter of the given shape."""
    role = quant_role(name)
    if role is QuantRole.BF16:
        return [StoredTensor(name, "BF16", tuple(logical_shape))]
    if role is QuantRole.F32:
        return [StoredTensor(name, "F32", tuple(logical_shape))]
    if len(logical_shape) != 2:
        raise ValueError(f"{name}: quantized tensors are 2-D, got shape {tuple(logical_shape)}")
    rows, cols = logical_shape
    if role is QuantRole.DENSE_FP8:
        scale = (math.ceil(rows / 32), math.ceil(cols / 32))
        return [StoredTensor(name, "F8_E4M3", (rows, cols)), StoredTensor(scale_name(name), "F8_E8M0", scale)]
    if cols % 32:
        raise ValueError(f"{name}: {role.value} needs an input width divisible by 32, got {cols}")
    if role is QuantRole.EXPERT_MXFP4:
        return [StoredTensor(name, "I8", (rows, cols // 2)), StoredTensor(scale_name(name), "F8_E8M0", (rows, cols // 32))]
    return [StoredTensor(name, "F8_E4M3", (rows, cols)), StoredTensor(scale_name(name), "F8_E8M0", (rows, cols // 32))]
