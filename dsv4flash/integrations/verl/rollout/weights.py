"""What a veRL weight sync hands the dsv4flash rollout, turned into reference-model terms.

* `adapter_from_sync`: the unmerged LoRA (the bridge's tensors + veRL's `peft_config`) -> the placement it forms
  and its canonical tensors, through the project's one layout conversion (`dsv4flash.lora.layouts`);
* `ReleaseDecoder`: base tensors -> reference parameters, decoding the release layout (FP8 dense, MXFP4
  experts, FP8 Engram, each with a `.scale` sibling that may arrive in a later bucket).
"""

from __future__ import annotations

import re

import torch

PEFT_PREFIX = "base_model.model."
_PACKED_EXPERTS = re.compile(r"\.ffn\.experts\.w[123]\.lora_[AB]\.weight$")  # fused 3-D [E, ...] factors


def adapter_from_sync(tensors: dict[str, torch.Tensor], peft_config: dict, cfg):
    """(LoraConfig placement, canonical fp32 tensors) of a synced adapter; errors name the tensor or key.

    Names are the bridge's (release names, `base_model.model.` optional): routed experts one 2-D LoRA per
    expert, or packed 3-D per layer and projection when the sync says so (a PEFT `target_parameters` on the
    experts, veRL's packed-MoE flag) or the names are the packed ones."""
    from dsv4flash.integrations.mbridge.peft_export import adapter_placement
    from dsv4flash.integrations.verl.adapter_loader import is_3d_payload
    from dsv4flash.lora.layouts import detect_modes, from_layout

    for key in ("r", "lora_alpha"):
        if key not in peft_config:
            raise ValueError(f"adapter sync: peft_config has no {key!r} (got keys {sorted(peft_config)})")
    rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
    plain = {name.removeprefix(PEFT_PREFIX): t.detach().to(torch.float32, copy=True) for name, t in tensors.items()}
    packed = is_3d_payload(peft_config) or any(_PACKED_EXPERTS.search(name) for name in plain)
    canonical = from_layout(plain, "packed" if packed else "megatron", rank=rank, source="adapter sync")
    wo_a_lora, _ = detect_modes(canonical)
    try:
        placement, _, _ = adapter_placement(canonical, cfg, rank=rank, alpha=alpha, wo_a_lora=wo_a_lora)
    except ValueError as exc:
        raise ValueError(f"adapter sync: received {exc}") from None
    return placement, canonical


class ReleaseDecoder:
    """Base-sync tensors -> (reference parameter name, full-precision tensor), one sync at a time.

    Full-precision tensors pass through (release names; `.base_layer.` spellings accepted). A quantized
    payload (a 1-byte or integer tensor under a quantized role) and its `.scale` are held until both arrived,
    then decoded with the release codecs."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, torch.Tensor]] = {}  # weight name -> {"payload"/"scale": tensor}

    def feed(self, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """The parameter this tensor completes, or None while its other half is outstanding."""
        from dsv4flash.integrations.verl.weight_names import strip_base_layer
        from dsv4flash.release.quant_plan import quant_role
        from dsv4flash_bridge import codecs
        from dsv4flash_bridge.convert_common import QUANTIZED

        key = strip_base_layer(name.removeprefix(PEFT_PREFIX))
        if key.endswith(".scale") and quant_role(key[: -len(".scale")] + ".weight") in QUANTIZED:
            key, part = key[: -len(".scale")] + ".weight", "scale"
        elif quant_role(key) in QUANTIZED and (not t.is_floating_point() or t.dtype.itemsize == 1):
            part = "payload"
        else:
            return key, t
        halves = self.pending.setdefault(key, {})
        halves[part] = t
        if len(halves) < 2:
            return None
        del self.pending[key]
        return key, codecs.decode(quant_role(key), halves["payload"], halves["scale"], name=key)

    def finish(self) -> None:
        """Refuse a sync that left a payload without its scale (or a scale without its payload)."""
        if self.pending:
            left = {k: sorted(v) for k, v in list(self.pending.items())[:3]}
            self.pending.clear()
            raise ValueError(f"base sync: quantized tensors arrived without their other half: {left}")
