"""AdapterRevision: immutable, content-addressed adapter bytes (weights + layout manifest).

A revision is one safetensors file. Its `__metadata__` carries the layout manifest (format, rank, alpha,
targets, expert geometry, base fingerprint, parent revision, policy, step), so the bytes are
self-describing and the revision id — the sha256 of the file — covers weights *and* manifest. Changing
anything, including the parent, gives a new id; publishing the same thing twice gives the same id.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from dsv4flash.lifecycle.errors import AdapterFormatError
from dsv4flash.lifecycle.fingerprint import BaseFingerprint, check_compatible
from dsv4flash.lifecycle.packed import PackedMoELoRA
from dsv4flash.lifecycle.safetensors_io import SafetensorsHeader, encode_header, read_safetensors

__all__ = ["LayoutManifest", "AdapterRevision", "FORMATS", "MANIFEST_KEY", "revision_tensors", "encode_revision", "manifest_from_header",
           "decode_adapter", "read_revision_file"]

MANIFEST_KEY = "dsv4flash.manifest"
# packed_moe_lora: PackedMoELoRA tensors. lora: any flat `*.lora_A/B.weight` set (e.g. per-expert).
# module_state: the trainable tensors of an arbitrary nn.Module (generic trainer checkpoints).
FORMATS = ("packed_moe_lora/1", "lora/1", "module_state/1")


@dataclass(frozen=True)
class LayoutManifest:
    """What the bytes are and where they belong: enough to load them without the catalog."""

    format: str
    policy: str
    base: BaseFingerprint
    parent: str | None = None
    rank: int | None = None
    alpha: float | None = None
    num_experts: int | None = None
    targets: tuple[str, ...] = ()
    step: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise AdapterFormatError(f"manifest format {self.format!r} is not one of {FORMATS}")
        if not self.policy:
            raise AdapterFormatError("manifest needs a policy name")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), part of the hashed bytes."""
        data = asdict(self)
        data["base"] = self.base.to_json()
        data["targets"] = list(self.targets)
        data["extra"] = dict(self.extra)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, *, source: str = "<manifest>") -> "LayoutManifest":
        """Parse a manifest, naming `source` on error."""
        try:
            data = json.loads(text)
            data["base"] = BaseFingerprint.from_json(data["base"])
            data["targets"] = tuple(data.get("targets", ()))
            return cls(**data)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise AdapterFormatError(f"{source}: malformed dsv4flash manifest ({exc})") from None


@dataclass(frozen=True)
class AdapterRevision:
    """A published revision: content id, manifest and payload size (the bytes live in the blob store)."""

    id: str
    manifest: LayoutManifest
    nbytes: int
    n_tensors: int

    @property
    def parent(self) -> str | None:
        """The revision this one was trained from."""
        return self.manifest.parent


def revision_tensors(payload: PackedMoELoRA | Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flat tensors to store, plus manifest fields implied by the payload type."""
    if isinstance(payload, PackedMoELoRA):
        targets = sorted({f"ffn.experts.{p}" for _, p in payload.experts} | {n.split(".", 2)[-1] if n.startswith("layers.") else n for n in payload.dense})
        return payload.to_packed_tensors(), {
            "format": "packed_moe_lora/1", "rank": payload.rank, "alpha": payload.alpha,
            "num_experts": payload.num_experts, "targets": tuple(targets),
        }
    tensors = dict(payload)
    is_lora = bool(tensors) and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in tensors)
    return tensors, {"format": "lora/1" if is_lora else "module_state/1"}


def encode_revision(tensors: Mapping[str, torch.Tensor], manifest: LayoutManifest) -> tuple[bytes, list[str], int]:
    """Header bytes, tensor order and total file size of a revision file."""
    head, order = encode_header(tensors, {"format": "pt", MANIFEST_KEY: manifest.to_json()})
    size = len(head) + sum(tensors[n].numel() * tensors[n].element_size() for n in order)
    return head, order, size


def manifest_from_header(header: SafetensorsHeader, *, source: str) -> LayoutManifest:
    """The manifest embedded in a revision file's header."""
    text = header.metadata.get(MANIFEST_KEY)
    if text is None:
        raise AdapterFormatError(f"{source}: no {MANIFEST_KEY!r} in the safetensors metadata — not a dsv4flash revision")
    return LayoutManifest.from_json(text, source=source)


def decode_adapter(tensors: Mapping[str, torch.Tensor], manifest: LayoutManifest, *, source: str) -> PackedMoELoRA | dict[str, torch.Tensor]:
    """Packed revisions come back as `PackedMoELoRA`, others as the flat tensor dict."""
    if manifest.format == "packed_moe_lora/1":
        return PackedMoELoRA.from_packed_tensors(tensors, alpha=float(manifest.alpha), source=source)
    return dict(tensors)


def read_revision_file(
    path: str | os.PathLike, *, resident_base: BaseFingerprint | None = None, pin_memory: bool = False, on_chunk=None
) -> tuple[dict[str, torch.Tensor], LayoutManifest, SafetensorsHeader]:
    """Read a revision file (one buffer) and refuse it if it was trained on another base."""
    tensors, header = read_safetensors(path, pin_memory=pin_memory, on_chunk=on_chunk)
    manifest = manifest_from_header(header, source=str(path))
    if resident_base is not None:
        check_compatible(manifest.base, resident_base, what=f"adapter revision {os.path.basename(path)} (policy {manifest.policy!r})")
    return tensors, manifest, header
