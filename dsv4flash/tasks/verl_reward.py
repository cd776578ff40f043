"""veRL custom reward function for the built-in tasks (`reward.custom_reward_function.path` points at this file).

veRL calls `compute_score(data_source, solution_str, ground_truth, extra_info)` once per response; the
exported rows carry the task name as `data_source` and the example's answer/meta in `extra_info`, so the
score is exactly the local engine's task verifier.
"""

from __future__ import annotations

import json
from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **_: Any) -> float:
    """Score one response with the task's own verifier (1 correct, 0 wrong; countdown: 0.1 well-formed)."""
    from dsv4flash.tasks import Example, build_task

    info = extra_info or {}
    options = json.loads(info.get("task_options", "{}"))
    task = build_task(data_source, **options)
    meta = json.loads(info.get("meta", "{}"))
    example = Example(prompt=info.get("prompt_text", ""), answer=str(ground_truth), meta=meta)
    # A Hugging Face decode of task ids spaces digits apart ("1 2"); score the task's own text form ("12").
    from dsv4flash.tasks.hf_tokenizer import canonical_text

    return float(task.reward(example, canonical_text(solution_str.strip())))
