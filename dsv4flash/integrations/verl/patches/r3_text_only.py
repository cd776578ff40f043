"""Runtime twin of DSV41-VERL-004: R3 replays text rows at their expanded positions; image rows route natively.

Why: vLLM records the experts of each token of the compact prompt (one placeholder per image) and veRL's R3
(`align_r3_router_replay_data`, `build_r3_replay_mask`) lines routes up with the training inputs row for row.
DeepSeek-V4.1 trains on the expanded sequence, where each image is a span routed with the image bias `bias_vl`: rows
no longer line up (R3 fails, or replays text routes onto image rows), and image rows must not be replayed at all
(docs/upstream.md §4.2). veRL's own router patch on megatron-core 0.19.2 additionally rejects sqrtsoftplus and skips
the expert bias (docs/upstream.md §4.2), so the routes must be replayed through dsv4flash's `ModalityTopKRouter`.

How: a batch may carry `r3_row_map` (nested, the training row of each recorded route row, −1 = none) and
`r3_native_rows` (nested, rows that always route natively), built by `dsv4flash.replay.r3_batch_keys`.
`align_r3_router_replay_data` scatters the recorded rows to their training rows and `build_r3_replay_mask` keeps
veRL's causal rule on the rows that have a recorded route and are not image rows; both take the keys as keyword
arguments (as the upstream form's `forward_step` passes them) or, since stock `forward_step` does not,
from the stash `MegatronEngineWithLMHead.prepare_model_inputs` leaves for the micro-batch. Batches without the
keys behave exactly as before.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = (
    "verl.utils.megatron.router_replay_utils.align_r3_router_replay_data",
    "verl.utils.megatron.router_replay_utils.build_r3_replay_mask",
    "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead.prepare_model_inputs",
)


def upstream_replays_text_only() -> bool:
    """Probe: does veRL's R3 alignment know the `r3_row_map` batch key?"""
    import inspect

    from verl.utils.megatron import router_replay_utils

    return "r3_row_map" in inspect.getsource(router_replay_utils)


@verl_twin(
    patch_id="DSV41-VERL-004",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_R3_TEXT_ONLY",
    tests=("tests/verl/test_r3_megatron.py",),
    upstream_has_it=upstream_replays_text_only,
)
def install(patcher: Patcher) -> None:
    """Replace the two R3 functions (in both namespaces) and stash the keys in `prepare_model_inputs`."""
    from verl.utils.megatron import router_replay_utils
    from verl.workers.engine.megatron import transformer_impl

    from dsv4flash.integrations.verl import replay

    align, build = router_replay_utils.align_r3_router_replay_data, router_replay_utils.build_r3_replay_mask

    def align_r3_router_replay_data(layers_topk_idx, input_ids, row_map=None):
        """veRL's alignment, or the text-only one given `row_map` or a micro-batch that carries it."""
        return replay.align_routes(layers_topk_idx, input_ids, align, row_map=row_map)

    def build_r3_replay_mask(input_ids, response_mask, row_map=None, native_rows=None):
        """veRL's mask, restricted to recorded non-native rows given the keys (or a micro-batch with them)."""
        return replay.replay_mask(input_ids, response_mask, build, row_map=row_map, native_rows=native_rows)

    prepare = transformer_impl.MegatronEngineWithLMHead.prepare_model_inputs

    def prepare_model_inputs(self, batch):
        """veRL's inputs; also stash the micro-batch's text-only replay keys."""
        replay.stash_micro_batch(batch)
        return prepare(self, batch)

    for module in (router_replay_utils, transformer_impl):
        patcher.replace(module, "align_r3_router_replay_data", align_r3_router_replay_data)
        patcher.replace(module, "build_r3_replay_mask", build_r3_replay_mask)
    patcher.replace(transformer_impl.MegatronEngineWithLMHead, "prepare_model_inputs", prepare_model_inputs)
