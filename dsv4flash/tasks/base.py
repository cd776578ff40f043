"""What a built-in task is: a seeded generator of examples with a verifiable reward."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Example:
    """One problem: a prompt (may hold `<image>` placeholders), its reference answer and optional images."""

    prompt: str
    answer: str
    images: tuple[np.ndarray, ...] = ()  # uint8 [H, W, 3], one per `<image>` in the prompt, reading order
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # what the reward needs

    def key(self) -> str:
        """Identity of the problem (prompt text and image bytes); used to keep splits disjoint."""
        digest = hashlib.sha1(self.prompt.encode())
        for img in self.images:
            digest.update(np.ascontiguousarray(img).tobytes())
        return digest.hexdigest()


class Task:
    """A task: `sample(rng)` draws one example, `reward(example, response)` scores a generated answer."""

    name: str = "task"
    multimodal: bool = False

    def sample(self, rng: np.random.Generator) -> Example:
        """Draw one example from the task distribution."""
        raise NotImplementedError

    def reward(self, example: Example, response: str) -> float:
        """Score a response in [0, 1]; the default is exact match with the reference answer."""
        return 1.0 if normalise(response) == normalise(example.answer) else 0.0

    def wrong_answer(self, example: Example, rng: np.random.Generator) -> str:
        """A plausible but wrong answer (the rejected side of a DPO pair)."""
        raise NotImplementedError

    def words(self) -> tuple[str, ...]:
        """Every word the task's prompts and answers use (the tokenizer's vocabulary is their union)."""
        raise NotImplementedError


def normalise(text: str) -> str:
    """Canonical form for comparing answers: lower case, no spaces."""
    return "".join(text.lower().split())
