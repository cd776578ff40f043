"""Builders for real vLLM 0.33 layers and punica metadata on CPU (used inside the `vllm_cpu` fixture)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def cpu_env() -> Iterator[object]:
    """A current VllmConfig plus vLLM's distributed env (gloo, TP=1), torn down afterwards."""
    import pytest
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if dist.is_initialized():
        pytest.skip("another test left a torch.distributed process group alive")
    config = VllmConfig()
    with set_current_vllm_config(config), tempfile.TemporaryDirectory(prefix="vllm-gloo-") as tmp:
        ps.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{tmp}/rdzv",
                                        local_rank=0, backend="gloo")
        ps.initialize_model_parallel(1, 1)
        try:
            yield config
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def lora_config(max_loras: int = 2, rank: int = 8, **kw):
    """A fp32 `LoRAConfig` (max_cpu_loras = max_loras)."""
    from vllm.config.lora import LoRAConfig

    return LoRAConfig(max_lora_rank=rank, max_loras=max_loras, lora_dtype=torch.float32, **kw)


def punica(max_tokens: int = 256, max_batches: int = 8):
    """vLLM's pure-torch punica wrapper."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    return PunicaWrapperCPU(max_tokens, max_batches, "cpu")


def set_tokens(wrapper, token_lora_ids: Sequence[int], prompt_lora_ids: Sequence[int],
               lora_index_to_id: Sequence[int | None], vocab_size: int = 512) -> None:
    """Install a prefill mapping the way the LoRA manager does (ids, not slots; 0 = no adapter)."""
    from vllm.lora.layers import LoRAMapping

    wrapper.update_metadata(LoRAMapping(tuple(token_lora_ids), tuple(prompt_lora_ids), is_prefill=True),
                            list(lora_index_to_id), len(lora_index_to_id) + 1, vocab_size)


def grouped_wo_a(weight: torch.Tensor, groups: int, prefix: str = "model.layers.0.attn.wo_a"):
    """A V4.1-style `wo_a`: ColumnParallelLinear [G·out_g, in_g] tagged as a batched GEMM, loaded with `weight`."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(weight.shape[1], weight.shape[0], bias=False, return_bias=False, prefix=prefix,
                                 params_dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    layer.is_bmm = True
    layer.bmm_batch_size = groups
    return layer


def compressor_projection(weights: Sequence[torch.Tensor], prefix: str = "model.layers.2.attn.compressor"):
    """The compressor's fused `[wkv ‖ wgate]` (or `[wkv]`) MergedColumnParallelLinear, replicated."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    sizes = [w.shape[0] for w in weights]
    layer = MergedColumnParallelLinear(weights[0].shape[1], sizes, bias=False, return_bias=False, quant_config=None,
                                       disable_tp=True, prefix=f"{prefix}.fused_wkv_wgate",
                                       params_dtype=weights[0].dtype)
    layer.weight.data.copy_(torch.cat(list(weights)))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def wrap(layer, packed: Sequence[str] = (), max_loras: int = 2, rank: int = 8, **kw):
    """vLLM's own `from_layer` over the (possibly patched) LoRA class table."""
    from vllm.lora.utils import from_layer

    return from_layer(layer, max_loras, lora_config(max_loras, rank, **kw), list(packed), None)
