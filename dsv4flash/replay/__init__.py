"""Text-only routing replay (R3) across the compact rollout sequence and the expanded training sequence.

vLLM records the experts each token was routed to on the *compact* prompt (one placeholder token per
image); Megatron trains on the *expanded* sequence, where each image is a span of `h·(w+1)+2` rows routed
with the image bias `bias_vl`. Replaying recorded routes must therefore (1) move every text row to its
expanded position and (2) leave image rows to the trainer's native routing.

| module      | what                                                                                   |
|-------------|----------------------------------------------------------------------------------------|
| `layout`    | `ImageSpanLayout`: where the images sit in the compact and the expanded sequence         |
| `routes`    | compact → expanded routes, the text-only replay mask, veRL batch keys (`r3_row_map`, `r3_native_rows`) |
| `reference` | record / replay on the reference model's `Gate` (the semantics every engine must match) |

Megatron-side replay goes through `dsv4flash.integrations.mcore.router.ModalityTopKRouter` (it routes image
rows with `bias_vl`), driven by veRL's own R3 machinery (`dsv4flash.integrations.verl`).
"""

from dsv4flash.replay.layout import ImageSpanLayout
from dsv4flash.replay.routes import expand_routes, r3_batch_keys, r3_replay_mask, row_map, text_replay_mask

__all__ = ["ImageSpanLayout", "expand_routes", "r3_batch_keys", "r3_replay_mask", "row_map", "text_replay_mask"]
