"""In-memory (tensor) LoRA adapters for vLLM 0.33 worker managers: what veRL's `TensorLoRARequest` loader must do.

veRL 0.9.1 hijacks `LRUCacheWorkerLoRAManager._load_adapter` to build adapters from tensors, but it calls
`hf_to_vllm_mapper.get_unstacked_mapper()` (renamed `get_rename_mapper` in vLLM 0.33: `AttributeError` on every
V4.1 sync), and drops what vLLM's own loader does: the model's `lora_skip_prefixes` (V4.1 `mtp.`), skipping
non-local experts under expert parallelism, stamping `is_3d_lora_weight`, and the MoE / classifier checks.
`load_adapter` does all of it; path-based requests go to vLLM's own loader unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def rename_mapper(model):
    """The model's weights mapper reduced to renames (vLLM >= 0.33 `get_rename_mapper`, 0.25-0.32 `get_unstacked_mapper`)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for method in ("get_rename_mapper", "get_unstacked_mapper"):
        fn = getattr(mapper, method, None)
        if callable(fn):
            return fn()
    return mapper


def is_3d_payload(peft_config: Mapping | None) -> bool:
    """Whether a PEFT config describes fused 3-D MoE LoRA (`target_parameters` on the experts, PEFT >= 0.18).

    Other parameter targets are not MoE payloads: dsv4flash's PEFT layout puts the grouped `attn.wo_a` (and an
    opt-in router) there while its routed experts stay 2-D per expert."""
    return any(".experts." in name or name.startswith("experts.")
               for name in (peft_config or {}).get("target_parameters") or ())


def local_expert_tensors(tensors: Mapping[str, torch.Tensor], ep_spec) -> dict[str, torch.Tensor]:
    """Drop per-expert tensors of experts another EP rank owns (`from_lora_tensors` has no `moe_ep_spec`)."""
    if ep_spec is None:
        return dict(tensors)
    from vllm.lora.lora_model import _is_remote_expert_key

    return {name: t for name, t in tensors.items() if not _is_remote_expert_key(name, ep_spec)}


def load_adapter(worker_manager, lora_request):
    """`_load_adapter` for path and tensor requests: tensors take vLLM's own steps through `from_lora_tensors`."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import WorkerLoRAManager

    tensors = getattr(lora_request, "lora_tensors", None)
    if tensors is None:
        return WorkerLoRAManager._load_adapter(worker_manager, lora_request)
    peft_config = getattr(lora_request, "peft_config", None)
    if not peft_config:
        raise ValueError(f"LoRA request {lora_request.lora_name!r} carries tensors but no peft_config")
    peft_helper = PEFTHelper.from_dict(dict(peft_config))
    peft_helper.validate_legal(worker_manager.lora_config)
    manager = worker_manager._adapter_manager
    model = manager.model
    lora = worker_manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors=local_expert_tensors(tensors, getattr(manager, "moe_ep_load_spec", None)),
        peft_helper=peft_helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=rename_mapper(model),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = bool(getattr(lora_request, "is_3d_lora_weight", False)) or is_3d_payload(peft_config)
    manager._validate_moe_lora_format(lora)
    manager._validate_classification_head_lora(lora)
    return lora
