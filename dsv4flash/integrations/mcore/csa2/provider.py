"""`DSV41ModelProvider`: V4.1 config in, megatron-core model out (the Megatron-Bridge `provide()` shape).

    provider = DSV41ModelProvider("tiny", recompute="full")   # or a config.json path / DSV41FlashConfig
    model = provider.provide()                                  # DSV41MegatronModel on this rank
    load_reference_state(model, reference.state_dict())         # optional: weights by release name

Parallel sizes come from megatron-core's `parallel_state` (initialise it first, as for any Megatron model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dsv4flash.config import DSV41FlashConfig, load_config

__all__ = ["DSV41ModelProvider", "RECOMPUTE_PRESETS"]

RECOMPUTE_PRESETS: dict[str, dict[str, Any]] = {
    "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=None),
}


@dataclass
class DSV41ModelProvider:
    """Builds `DSV41MegatronModel` for a V4.1 config; `overrides` go to the `TransformerConfig`."""

    cfg: Any = "tiny"
    backend: str = "local"  # "local" (CPU/GPU) or "transformer_engine" (GPU)
    recompute: str = "none"  # a RECOMPUTE_PRESETS key; or set recompute_* in overrides
    moe_grouped_gemm: bool = False  # TE grouped GEMM experts (GPU)
    fused_router: bool = False  # TE fused top-k router (GPU, TE >= 2.13 for sqrtsoftplus)
    parallel_output: bool = True
    engram: Any = None  # spec/class for Engram layers (default: the plain lookup, CSA2Engram)
    freeze_vision_model: bool = True  # the ViT (`vision_model`) gets no gradients, as Megatron-Bridge VL providers
    freeze_vision_projection: bool = True  # the aligner (`vision_projection`)
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def dsv4(self) -> DSV41FlashConfig:
        """The V4.1 config."""
        return load_config(self.cfg)

    def transformer_config(self):
        """The `CSA2TransformerConfig`, with the current parallel sizes and the recompute preset."""
        from megatron.core import parallel_state

        from dsv4flash.integrations.mcore.csa2.config import transformer_config_from

        if self.recompute not in RECOMPUTE_PRESETS:
            raise ValueError(f"DSV41ModelProvider.recompute must be one of {sorted(RECOMPUTE_PRESETS)}, "
                             f"got {self.recompute!r}")
        fields: dict[str, Any] = dict(RECOMPUTE_PRESETS[self.recompute])
        if self.recompute == "full_block":
            # Every layer but the last: its activations are consumed as soon as its forward ends, so
            # recomputing it costs a layer's forward and saves nothing (the benchmark shows both).
            fields["recompute_num_layers"] = max(1, self.dsv4.text.num_hidden_layers - 1)
        if parallel_state.model_parallel_is_initialized():
            fields.update(
                tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                context_parallel_size=parallel_state.get_context_parallel_world_size(),
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
            )
        if self.backend == "transformer_engine":
            fields.update(moe_grouped_gemm=self.moe_grouped_gemm, moe_router_fusion=self.fused_router,
                          use_cpu_initialization=False)
        elif self.moe_grouped_gemm or self.fused_router:
            raise ValueError("moe_grouped_gemm / fused_router need backend='transformer_engine'")
        fields.update(self.overrides)
        return transformer_config_from(self.dsv4, **fields)

    def provide(self, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                vp_stage: Optional[int] = None):
        """Build this rank's pipeline stage (the whole stack at PP = 1); None = from `parallel_state`."""
        from megatron.core import parallel_state

        from dsv4flash.integrations.mcore.csa2.model import DSV41MegatronModel
        from dsv4flash.integrations.mcore.csa2.specs import get_csa2_block_spec

        if vp_stage not in (None, 0):
            raise ValueError("DSV41ModelProvider: virtual pipeline stages are not supported (vp_stage must be "
                             "None; use the non-interleaved 1F1B schedule)")
        config = self.transformer_config()
        pipelined = config.pipeline_model_parallel_size > 1
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage() if pipelined else True
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage() if pipelined else True
        if not pipelined and not (pre_process and post_process):
            raise ValueError("DSV41ModelProvider: pre_process/post_process False needs pipeline parallelism "
                             "(pipeline_model_parallel_size > 1)")
        spec = get_csa2_block_spec(config, backend=self.backend, engram=self.engram)
        model = DSV41MegatronModel(config, spec, parallel_output=self.parallel_output, pre_process=pre_process,
                                   post_process=post_process)
        model.freeze(freeze_vision_model=self.freeze_vision_model,
                     freeze_vision_projection=self.freeze_vision_projection)
        return model
