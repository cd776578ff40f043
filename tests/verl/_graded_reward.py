"""A veRL custom reward with partial credit for the arithmetic task (tests/verl/test_grpo_resume.py): the task's
own verifier (1 for the exact value), else up to 0.5 for a number close to it. The pretrained tiny base
answers arithmetic with numbers near the target but rarely exact, so exact-match rewards of a 2-prompt step
are usually all 0 (no advantage, no update); graded ones give GRPO a spread to learn from."""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs: Any) -> float:
    """veRL's custom reward signature; the task verifier's score, else closeness of the answered number."""
    from dsv4flash.tasks.hf_tokenizer import canonical_text
    from dsv4flash.tasks.verl_reward import compute_score as task_score

    exact = task_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if exact > 0:
        return exact
    try:
        value, target = int(canonical_text(solution_str.strip())), int(str(ground_truth))
    except ValueError:  # not a number: no credit
        return 0.0
    return 0.5 * max(0.0, 1.0 - abs(value - target) / (abs(target) + 1))
