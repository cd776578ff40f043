"""Runtime twin of DSV41-VERL-014: token-aligned multimodal inputs come from the trajectory's own token ids.

Why: `AgentLoopWorker._compute_multi_modal_inputs` decodes the padded prompt + response ids with
`skip_special_tokens=True` and runs the processor on that text again. The round trip drops special
placeholders (DeepSeek-V4.1's `<image>` is an additional special token) and bos/eos, so a processor whose
outputs are aligned with the tokens (V4.1's `token_types`, which mark the image spans the model fills) refuses
the images ("1 images given but the text has 0 <image> placeholders") or returns rows that no longer line up
with the ids the actor trains on.

How: a processor that has `token_aligned_inputs(token_ids, images=..., videos=...)` (V4.1's:
`dsv4flash.hf.processing.DeepseekV41Processor`) gets the trajectory's own `prompt_ids + response_ids` and
returns the multimodal inputs for them; other processors (and audio) keep veRL's decode path. The twin wraps
`_compute_multi_modal_inputs`.
"""

from __future__ import annotations

from dsv4flash.patching.twins import Patcher
from dsv4flash.integrations.verl.patches import verl_twin

TOUCHES = ("verl.experimental.agent_loop.agent_loop.AgentLoopWorker._compute_multi_modal_inputs",)


def upstream_uses_token_aligned_inputs() -> bool:
    """Probe: does veRL's `_compute_multi_modal_inputs` ask the processor for `token_aligned_inputs`?"""
    import inspect

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    return "token_aligned_inputs" in inspect.getsource(AgentLoopWorker._compute_multi_modal_inputs)


@verl_twin(
    patch_id="DSV41-VERL-014",
    touches=TOUCHES,
    gate="DSV4FLASH_VERL_TOKEN_ALIGNED_INPUTS",
    tests=("tests/verl/test_token_aligned_inputs.py",),
    upstream_has_it=upstream_uses_token_aligned_inputs,
)
def install(patcher: Patcher) -> None:
    """Wrap `AgentLoopWorker._compute_multi_modal_inputs`."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    stock = AgentLoopWorker._compute_multi_modal_inputs

    def _compute_multi_modal_inputs(self, output, input_ids):
        """veRL's multimodal inputs; a token-aligned processor gets the trajectory's own token ids."""
        aligned = getattr(self.processor, "token_aligned_inputs", None)
        data = output.multi_modal_data or {}
        if aligned is None or data.get("audios") is not None:
            return stock(self, output, input_ids)
        inputs = aligned(list(output.prompt_ids) + list(output.response_ids), images=data.get("images"),
                         videos=data.get("videos"))
        inputs.pop("input_ids", None)
        inputs.pop("attention_mask", None)
        return dict(inputs.convert_to_tensors("pt"))

    patcher.replace(AgentLoopWorker, "_compute_multi_modal_inputs", _compute_multi_modal_inputs)
