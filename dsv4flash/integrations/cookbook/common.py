"""What both cookbook builders share: a task's seeded examples and their encoding with the cookbook tokenizer."""

from __future__ import annotations

import numpy as np


def task_example(task_name: str, seed: int, split: int, index: int):
    """Example `index` of a split (0 train, 1 test) of a built-in task: a pure function of the seed."""
    from dsv4flash.tasks import build_task

    return build_task(task_name).sample(np.random.default_rng([seed, split, index]))


def encode_prompt(tokenizer, text: str) -> list[int]:
    """bos + text with the task tokenizer's ids, as the local engine encodes a prompt (the served tokenizer adds
    no specials itself; its whitespace bytes are left out: `encode_task_text`)."""
    from dsv4flash.tasks.text_tokenizer import encode_task_text

    if tokenizer.bos_token_id is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no bos token: not a "
                         f"dsv4flash task tokenizer (give model_name = the directory dsv4flash serve lists)")
    return [int(tokenizer.bos_token_id)] + encode_task_text(tokenizer, text)
