"""Text task: two-operand integer arithmetic, answer checked exactly (or with partial credit for a close number)."""

from __future__ import annotations

import numpy as np

from dsv4flash.tasks.base import Example, Task, normalise


class ArithmeticTask(Task):
    """`q : 12 + 7 = ? a :` -> `19`; sums/differences of numbers below `max_operand`, products of digits.

    `partial_credit`: a wrong number scores up to 0.5 by closeness. A small base answers near the target
    long before it answers exactly, so exact-match rewards of a few-prompt GRPO step are often all 0 (no
    advantage, no update); graded ones give GRPO a spread to learn from.
    """

    name = "arithmetic"

    def __init__(self, max_operand: int = 50, partial_credit: bool = False) -> None:
        self.max_operand = max_operand
        self.partial_credit = partial_credit

    def sample(self, rng: np.random.Generator) -> Example:
        """Draw an operator, then operands (differences never negative)."""
        op = ("+", "-", "*")[int(rng.integers(3))]
        if op == "*":
            a, b = (int(x) for x in rng.integers(0, 10, size=2))
        else:
            a, b = (int(x) for x in rng.integers(0, self.max_operand, size=2))
            if op == "-" and b > a:
                a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Example(prompt=f"q : {a} {op} {b} = ? a :", answer=str(value), meta={"value": value})

    def reward(self, example: Example, response: str) -> float:
        """1 for the exact value; else 0, or with `partial_credit` 0.5 * (1 - |answer - value| / (|value| + 1))."""
        answer, value = normalise(response), int(example.meta["value"])
        if answer == str(value):
            return 1.0
        if not self.partial_credit:
            return 0.0
        try:
            number = int(answer)
        except ValueError:  # not a number: no credit
            return 0.0
        return 0.5 * max(0.0, 1.0 - abs(number - value) / (abs(value) + 1))

    def wrong_answer(self, example: Example, rng: np.random.Generator) -> str:
        """The true value moved by a small non-zero offset (kept non-negative)."""
        value = example.meta["value"]
        offsets = [d for d in (-3, -2, -1, 1, 2, 3) if value + d >= 0]
        return str(value + offsets[int(rng.integers(len(offsets)))])

    def words(self) -> tuple[str, ...]:
        """Digits, operators and the q/a template."""
        return (*"0123456789", "+", "-", "*", "=", "?", "q", "a", ":")
