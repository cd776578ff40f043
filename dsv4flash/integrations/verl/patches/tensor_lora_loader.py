"""Runtime twin of DSV41-VERL-001: veRL's in-memory LoRA loader works on vLLM 0.33 and keeps what vLLM's does.

Why: `VLLMHijack.hijack` replaces `LRUCacheWorkerLoRAManager._load_adapter` with a loader for `TensorLoRARequest`s
that calls `hf_to_vllm_mapper.get_unstacked_mapper()` on vLLM >= 0.25; vLLM 0.33 renamed it `get_rename_mapper`, so
every unmerged adapter sync to a model with a mapper (all of V4.1) raises `AttributeError` (docs/upstream.md §4.1).
It also drops `lora_skip_prefixes` (V4.1's `mtp.` draft head), expert-parallel filtering, the `is_3d_lora_weight`
flag of fused 3-D MoE adapters and the MoE-format / classifier checks (docs/upstream.md §4.1). A vLLM general plugin
cannot fix it by patching `_load_adapter`: veRL's worker extension runs the hijack after vLLM's plugins and
overwrites it (docs/upstream.md §4.1).

How: wrap `VLLMHijack.hijack` so that after veRL installs its loader, the fixed one
(`dsv4flash.integrations.verl.adapter_loader.load_adapter`) is installed on top; it is also installed right
away for processes where the hijack never runs. Tensor requests go through `LoRAModel.from_lora_tensors` with
the rename mapper, the model's skip prefixes, local experts only, the 3-D flag (from the request or a PEFT
`target_parameters` config) and vLLM's own validations; path requests go to vLLM's own loader.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.utils.vllm.utils.VLLMHijack.hijack",)


def upstream_loader_handles_vllm_033() -> bool:
    """Probe: does veRL's in-memory loader know vLLM 0.33's `get_rename_mapper`?"""
    import inspect

    from verl.utils.vllm import utils

    return "get_rename_mapper" in inspect.getsource(utils)


@verl_twin(
    patch_id="DSV41-VERL-001",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_TENSOR_LORA_LOADER",
    tests=("tests/verl/test_adapter_loader.py",),
    upstream_has_it=upstream_loader_handles_vllm_033,
)
def install(patcher: Patcher) -> None:
    """Chain `VLLMHijack.hijack` and install the fixed `_load_adapter` now and after every hijack."""
    from verl.utils.vllm import utils
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from dsv4flash.integrations.verl.adapter_loader import load_adapter

    def _load_adapter(self, lora_request):
        """Path or tensor adapter, loaded the way vLLM 0.33 loads path adapters."""
        return load_adapter(self, lora_request)

    verl_hijack = utils.VLLMHijack.__dict__["hijack"].__func__

    def hijack() -> None:
        """veRL's hijack, then the vLLM 0.33 loader on top of the one it installed."""
        verl_hijack()
        patcher.replace(LRUCacheWorkerLoRAManager, "_load_adapter", _load_adapter)

    patcher.replace(LRUCacheWorkerLoRAManager, "_load_adapter", _load_adapter)
    patcher.replace(utils.VLLMHijack, "hijack", staticmethod(hijack))
