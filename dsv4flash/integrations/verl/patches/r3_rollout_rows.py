"""Runtime twin of DSV41-VERL-013: the agent loop maps the rollout's recorded routes onto the training rows.

Why: `AgentLoopWorker._agent_loop_postprocess` writes the rollout's `routed_experts` row for row from the first
prompt token, as if the rollout had recorded one route per training token. A multimodal model whose rollout
records routes on another layout (DeepSeek-V4.1: one placeholder per image in vLLM, the expanded image span
in training) gets compact routes next to expanded prompt ids, so veRL's R3 replays text routes onto the wrong
rows and image rows with routes chosen under the text bias; the text-only replay keys veRL's R3 reads
(`r3_row_map`, `r3_native_rows`, DSV41-VERL-004) are never built.

How: the upstream form asks the processor, when it has `routing_replay_rows(token_ids, num_route_rows,
multi_modal_inputs)` (V4.1's: `dsv4flash.hf.processing.DeepseekV41Processor`, which calls
`dsv4flash.replay.r3_batch_keys` on the sample's `ImageSpanLayout`), for the training row of each recorded
route row and the natively routed rows; `_agent_loop_postprocess` pads them like `routed_experts`
(`[1, prompt_length + response_length]`, −1 / False outside the sample), `_postprocess` puts them into the
batch next to `routed_experts`, and `left_right_2_no_padding` unpads them like `routed_experts` (the jagged
form DSV41-VERL-004 reads). Processors without the method: nothing changes. The twin wraps the three
functions; the padded tensors travel from `_agent_loop_postprocess` to `_postprocess` in the output's
`extra_fields` under a private key that `_postprocess` removes before veRL sees it.
"""

from __future__ import annotations

import sys

import torch

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = (
    "verl.experimental.agent_loop.agent_loop.AgentLoopWorker._agent_loop_postprocess",
    "verl.experimental.agent_loop.agent_loop.AgentLoopWorker._postprocess",
    "verl.workers.utils.padding.left_right_2_no_padding",
)
KEYS = ("r3_row_map", "r3_native_rows")
_CARRY = "__dsv4flash_r3_rows__"  # extra_fields key between the two agent-loop steps (removed by _postprocess)


def routing_replay_rows(processor, prompt_ids, response_ids, num_route_rows: int, multi_modal_inputs: dict, *,
                        start_pos: int, total_length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The processor's (row_map, native_rows) of one sample, padded like `routed_experts` ([1, total_length])."""
    rows_fn = getattr(processor, "routing_replay_rows", None)
    if rows_fn is None:
        return None
    token_ids = list(prompt_ids) + list(response_ids)
    row_map, native = rows_fn(token_ids, num_route_rows, multi_modal_inputs)
    row_map, native = torch.as_tensor(row_map, dtype=torch.int64), torch.as_tensor(native, dtype=torch.bool)
    if tuple(row_map.shape) != (num_route_rows,) or tuple(native.shape) != (len(token_ids),):
        raise ValueError(f"routing_replay_rows returned row_map {tuple(row_map.shape)} and native_rows "
                         f"{tuple(native.shape)}; expected ({num_route_rows},) and ({len(token_ids)},)")
    padded_map = torch.full((1, total_length), -1, dtype=torch.int64)
    padded_map[0, start_pos:start_pos + num_route_rows] = row_map
    padded_native = torch.zeros((1, total_length), dtype=torch.bool)
    padded_native[0, start_pos:start_pos + len(token_ids)] = native
    return padded_map, padded_native


def upstream_maps_rollout_routes() -> bool:
    """Probe: does veRL's agent loop ask the processor where recorded routes replay?"""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    return hasattr(AgentLoopWorker, "_compute_routing_replay_rows")


@verl_twin(
    patch_id="DSV41-VERL-013",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_R3_ROLLOUT_ROWS",
    tests=("tests/verl/test_r3_rollout_rows.py",),
    depends_on=("DSV41-VERL-004",),
    upstream_has_it=upstream_maps_rollout_routes,
)
def install(patcher: Patcher) -> None:
    """Wrap the agent loop's two post-processing steps and `left_right_2_no_padding` (where veRL binds it)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.utils import padding

    postprocess_one, postprocess_all = AgentLoopWorker._agent_loop_postprocess, AgentLoopWorker._postprocess
    unpad = padding.left_right_2_no_padding

    async def _agent_loop_postprocess(self, output, validate, **kwargs):
        """veRL's per-sample post-processing; also where the recorded routes replay (the processor's rows)."""
        result = await postprocess_one(self, output, validate, **kwargs)
        if result.routed_experts is not None and output.routed_experts is not None:
            rows = routing_replay_rows(self.processor, output.prompt_ids, output.response_ids,
                                       len(output.routed_experts), result.multi_modal_inputs or {},
                                       start_pos=result.prompt_ids.shape[1] - len(output.prompt_ids),
                                       total_length=result.input_ids.shape[1])
            if rows is not None:
                result.extra_fields[_CARRY] = rows
        return result

    def _postprocess(self, inputs, *args, **kwargs):
        """veRL's batch assembly, with `r3_row_map` / `r3_native_rows` next to `routed_experts`."""
        rows = [item.extra_fields.pop(_CARRY, None) for item in inputs]
        out = postprocess_all(self, inputs, *args, **kwargs)
        if rows and all(r is not None for r in rows):
            for i, key in enumerate(KEYS):
                out.batch[key] = torch.cat([r[i] for r in rows], dim=0)
        return out

    def left_right_2_no_padding(data):
        """veRL's unpadding; the text-only replay keys are unpadded like `routed_experts`."""
        from verl.utils.attention_utils import index_first_axis
        from verl.utils import tensordict_utils as tu

        padded = {k: data.get(k, None) for k in KEYS}
        out = unpad(data)
        indices = tu.get_non_tensor_data(out, key="indices", default=None)
        offsets = out["input_ids"].offsets()
        for key, value in padded.items():
            if value is not None and not value.is_nested:
                flat = index_first_axis(value.unsqueeze(-1).flatten(0, 1), indices)
                out[key] = torch.nested.nested_tensor_from_jagged(flat.squeeze(-1), offsets=offsets)
        return out

    patcher.replace(AgentLoopWorker, "_agent_loop_postprocess", _agent_loop_postprocess)
    patcher.replace(AgentLoopWorker, "_postprocess", _postprocess)
    patcher.replace(padding, "left_right_2_no_padding", left_right_2_no_padding)
    trainer = sys.modules.get("verl.trainer.ppo.ray_trainer")
    if trainer is not None and getattr(trainer, "left_right_2_no_padding", None) is unpad:
        patcher.replace(trainer, "left_right_2_no_padding", left_right_2_no_padding)
