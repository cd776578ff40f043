"""Seeded, disjoint train/validation streams over a task mixture, and their encoding into model batches.

Example `i` of the validation split and the training examples of step `s` are pure functions of the
seed, so a resumed run sees exactly the batches it would have seen; training draws that collide with a
validation problem are redrawn (like the study's removal of images shared between splits). Training draws
fresh problems every step, or with `train_size` cycles over a fixed set of that many (the first problems of
the same stream, which are also the rows of the veRL export), in a new seeded order each epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dsv4flash.config import DSV41FlashConfig
from dsv4flash.tasks.base import Example, Task
from dsv4flash.tasks.tokenizer import TaskTokenizer

_VAL_STREAM, _TRAIN_STREAM, _AUX_STREAM, _EPOCH_STREAM = 1, 2, 3, 4
_CHUNK = 256  # problems drawn per stream step when a finite training set is built


class TaskMixture:
    """Weighted mixture of tasks with a fixed validation split and a per-step training stream (`train_size`: a fixed
    training set of that many problems instead)."""

    def __init__(self, tasks: dict[str, Task], weights: dict[str, float], seed: int, val_size: int,
                 train_size: int | None = None) -> None:
        if not tasks:
            raise ValueError("task mixture: no tasks given")
        missing = set(weights) ^ set(tasks)
        if missing:
            raise ValueError(f"task mixture: weights and tasks disagree on {sorted(missing)}")
        self.tasks = tasks
        self.names = sorted(tasks)
        total = float(sum(weights[n] for n in self.names))
        if total <= 0 or any(weights[n] < 0 for n in self.names):
            raise ValueError(f"task mixture: weights must be non-negative with a positive sum, got {weights}")
        self.probs = np.array([weights[n] / total for n in self.names])
        self.seed = seed
        rng = np.random.default_rng([seed, _VAL_STREAM])
        self.val: list[tuple[str, Example]] = [self._draw(rng) for _ in range(val_size)]
        self._val_keys = {ex.key() for _, ex in self.val}
        if train_size is not None and train_size < 1:
            raise ValueError(f"data.train_size must be a positive number of problems or null, got {train_size}")
        self.train_size = train_size
        self._train_set: list[tuple[str, Example]] | None = None

    def _draw(self, rng: np.random.Generator) -> tuple[str, Example]:
        name = self.names[int(rng.choice(len(self.names), p=self.probs))]
        return name, self.tasks[name].sample(rng)

    def train_batch(self, step: int, batch_size: int) -> list[tuple[str, Example]]:
        """The training examples of one step (never a validation problem): fresh draws, or with `train_size` the
        next `batch_size` problems of the fixed set, read in a new seeded order each epoch."""
        if self.train_size is None:
            return self._draw_batch(step, batch_size)
        if self._train_set is None:
            self._train_set = self.train_problems(self.train_size)
        n, first = self.train_size, step * batch_size
        out = []
        for epoch in range(first // n, (first + batch_size - 1) // n + 1):
            order = np.random.default_rng([self.seed, _EPOCH_STREAM, epoch]).permutation(n)
            lo, hi = max(first, epoch * n), min(first + batch_size, (epoch + 1) * n)
            out += [self._train_set[int(order[pos - epoch * n])] for pos in range(lo, hi)]
        return out

    def train_problems(self, count: int) -> list[tuple[str, Example]]:
        """The first `count` problems of the training stream: the finite training set of that size."""
        out: list[tuple[str, Example]] = []
        step = 0
        while len(out) < count:
            out += self._draw_batch(step, min(_CHUNK, count - len(out)))
            step += 1
        return out

    def _draw_batch(self, step: int, batch_size: int) -> list[tuple[str, Example]]:
        rng = np.random.default_rng([self.seed, _TRAIN_STREAM, step])
        out = []
        while len(out) < batch_size:
            name, ex = self._draw(rng)
            if ex.key() not in self._val_keys:
                out.append((name, ex))
        return out

    def step_rng(self, step: int) -> np.random.Generator:
        """An auxiliary generator for step `step` (e.g. DPO rejected answers), independent of the batch draw."""
        return np.random.default_rng([self.seed, _AUX_STREAM, step])

    def reward(self, name: str, example: Example, response: str) -> float:
        """Score a response with its task's verifier."""
        return self.tasks[name].reward(example, response)


@dataclass
class Batch:
    """A right-padded batch. `target_mask[b, t]` marks tokens that are scored (predicted from position t−1)."""

    input_ids: torch.Tensor  # [B,S] int64
    token_types: torch.Tensor  # [B,S] int64, −1 text / ≥0 image-span codes
    images: list  # ImageInput per image span, batch-major reading order
    target_mask: torch.Tensor  # [B,S] bool
    lengths: torch.Tensor  # [B] valid tokens per row

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return int(self.input_ids.shape[0])


class Encoder:
    """Turns examples into token sequences: `<bos> prompt` then `answer <eos>` (images expanded into spans)."""

    def __init__(self, tokenizer: TaskTokenizer, cfg: DSV41FlashConfig) -> None:
        self.tok, self.cfg = tokenizer, cfg

    def prompt(self, ex: Example) -> tuple[torch.Tensor, torch.Tensor, list]:
        """-> (ids [P], token_types [P], image inputs) of the prompt with image spans expanded."""
        from dsv4flash.model.image import TEXT, expand_image_placeholders, preprocess_image

        ids = self.tok.encode(ex.prompt, bos=True)
        if not ex.images:
            t = torch.tensor(ids, dtype=torch.int64)
            return t, torch.full_like(t, TEXT), []
        images = [preprocess_image(img, self.cfg, dtype=torch.float32) for img in ex.images]
        full_ids, types = expand_image_placeholders(ids, images, self.cfg)
        return full_ids, types, images

    def answer(self, text: str) -> torch.Tensor:
        """-> ids [A] of `answer <eos>`."""
        return torch.tensor(self.tok.encode(text, eos=True), dtype=torch.int64)

    def batch(self, examples: Sequence[Example], answers: Sequence[str] | None = None,
              score_prompt: bool = False) -> Batch:
        """Prompt + answer per row (the reference answers unless `answers` is given); scores the answer tokens."""
        rows = []
        for i, ex in enumerate(examples):
            p_ids, p_types, imgs = self.prompt(ex)
            a_ids = self.answer(ex.answer if answers is None else answers[i])
            rows.append((p_ids, p_types, imgs, a_ids))
        return self.collate(rows, score_prompt=score_prompt)

    def collate(self, rows: Sequence[tuple[torch.Tensor, torch.Tensor, list, torch.Tensor]],
                score_prompt: bool = False) -> Batch:
        """Rows of (prompt ids, prompt types, images, continuation ids) -> padded Batch."""
        from dsv4flash.model.image import TEXT

        lengths = [int(p.numel() + a.numel()) for p, _, _, a in rows]
        seq = max(lengths)
        bsz = len(rows)
        input_ids = torch.full((bsz, seq), self.tok.pad_id, dtype=torch.int64)
        token_types = torch.full((bsz, seq), TEXT, dtype=torch.int64)
        target = torch.zeros((bsz, seq), dtype=torch.bool)
        images: list = []
        for b, (p_ids, p_types, imgs, a_ids) in enumerate(rows):
            n_p, n = p_ids.numel(), lengths[b]
            input_ids[b, :n_p], input_ids[b, n_p:n] = p_ids, a_ids
            token_types[b, :n_p] = p_types
            target[b, n_p:n] = True
            if score_prompt:  # language-model pretraining: every text token after bos is scored
                target[b, 1:n_p] = p_types[1:] == TEXT
            images.extend(imgs)
        return Batch(input_ids, token_types, images, target, torch.tensor(lengths))
