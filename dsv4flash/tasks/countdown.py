"""Text task: countdown — combine the given numbers with + - * to hit a target; any correct expression wins."""

from __future__ import annotations

import itertools

import numpy as np

from dsv4flash.tasks.base import Example, Task

_OPS = ("+", "-", "*")


class ExpressionError(ValueError):
    """A response that is not a well-formed expression over digits, + - * and parentheses."""


def evaluate(text: str) -> tuple[int, list[int]]:
    """Evaluate an integer expression (+ - * and parentheses, usual precedence) -> (value, numbers used)."""
    tokens: list[str] = []
    for ch in "".join(text.split()):
        if ch.isdigit() and tokens and tokens[-1].isdigit():
            tokens[-1] += ch
        elif ch.isdigit() or ch in "+-*()":
            tokens.append(ch)
        else:
            raise ExpressionError(f"unexpected character {ch!r}")
    pos = 0
    numbers: list[int] = []

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ExpressionError("expression ends early")
        pos += 1
        return tokens[pos - 1]

    def atom() -> int:
        tok = take()
        if tok == "(":
            value = expr()
            if take() != ")":
                raise ExpressionError("missing ')'")
            return value
        if not tok.isdigit():
            raise ExpressionError(f"expected a number, got {tok!r}")
        numbers.append(int(tok))
        return int(tok)

    def term() -> int:
        value = atom()
        while peek() == "*":
            take()
            value *= atom()
        return value

    def expr() -> int:
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    if not tokens:
        raise ExpressionError("empty expression")
    value = expr()
    if pos != len(tokens):
        raise ExpressionError(f"trailing tokens {tokens[pos:]}")
    return value, numbers


class CountdownTask(Task):
    """`q : numbers 3 , 5 , 7 target 22 a :` -> e.g. `3 * 5 + 7` (each number exactly once)."""

    name = "countdown"

    def __init__(self, n_numbers: int = 3, max_number: int = 9, format_reward: float = 0.1) -> None:
        self.n_numbers, self.max_number, self.format_reward = n_numbers, max_number, format_reward

    def sample(self, rng: np.random.Generator) -> Example:
        """Numbers in [1, max_number], a random left-to-right expression over them gives a non-negative target."""
        while True:
            nums = [int(x) for x in rng.integers(1, self.max_number + 1, size=self.n_numbers)]
            ops = [_OPS[int(i)] for i in rng.integers(len(_OPS), size=self.n_numbers - 1)]
            text = " ".join(itertools.chain.from_iterable(zip(map(str, nums), ops))) + f" {nums[-1]}"
            target, _ = evaluate(text)
            if 0 <= target < 100:
                break
        shown = ", ".join(map(str, sorted(nums)))
        return Example(prompt=f"q : numbers {shown} target {target} a :", answer=text,
                       meta={"numbers": sorted(nums), "target": target})

    def reward(self, example: Example, response: str) -> float:
        """1 if it uses each number once and hits the target, `format_reward` if only well-formed, else 0."""
        try:
            value, used = evaluate(response)
        except ExpressionError:
            return 0.0
        if sorted(used) != example.meta["numbers"]:
            return 0.0
        return 1.0 if value == example.meta["target"] else self.format_reward

    def wrong_answer(self, example: Example, rng: np.random.Generator) -> str:
        """A well-formed expression over the same numbers that misses the target."""
        nums = list(example.meta["numbers"])
        for _ in range(100):
            order = [nums[int(i)] for i in rng.permutation(len(nums))]
            ops = [_OPS[int(i)] for i in rng.integers(len(_OPS), size=len(nums) - 1)]
            text = " ".join(itertools.chain.from_iterable(zip(map(str, order), ops))) + f" {order[-1]}"
            if evaluate(text)[0] != example.meta["target"]:
                return text
        return " + ".join(map(str, nums)) + " + 1"  # every number once plus one: always off target

    def words(self) -> tuple[str, ...]:
        """Digits, operators, parentheses and the prompt words."""
        return (*"0123456789", "+", "-", "*", "(", ")", ",", "q", "a", ":", "numbers", "target")
