"""A cookbook `SupervisedDatasetBuilder` over a built-in task: prompt weight 0, answer + eos weight 1."""

from __future__ import annotations

import chz
import tinker
import torch
from tinker_cookbook.supervised.common import datum_from_model_input_weights
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from dsv4flash.integrations.cookbook.common import encode_prompt, task_example
from dsv4flash.tasks.text_tokenizer import encode_task_text


class TaskSupervisedDataset(SupervisedDataset):
    """`n_batches` batches of `batch_size` task examples; epoch e reshuffles with seed e (deterministic)."""

    def __init__(self, data: list[tinker.Datum], batch_size: int) -> None:
        self.data, self.batch_size = data, batch_size
        self.order = list(range(len(data)))

    def get_batch(self, index: int) -> list[tinker.Datum]:
        """Batch `index` in this epoch's order."""
        return [self.data[i] for i in self.order[index * self.batch_size:(index + 1) * self.batch_size]]

    def __len__(self) -> int:
        return len(self.data) // self.batch_size

    def set_epoch(self, seed: int = 0) -> None:
        """Reorder the examples for a new epoch."""
        self.order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(seed)).tolist()


def task_datum(tokenizer, example) -> tinker.Datum:
    """One supervised datum: bos + prompt (weight 0), answer + eos (weight 1), shifted by the cookbook."""
    prompt = encode_prompt(tokenizer, example.prompt)
    answer = encode_task_text(tokenizer, example.answer) + [int(tokenizer.eos_token_id)]
    weights = torch.tensor([0.0] * len(prompt) + [1.0] * len(answer))
    return datum_from_model_input_weights(tinker.ModelInput.from_ints(prompt + answer), weights)


@chz.chz
class TaskSupervisedDatasetBuilder(SupervisedDatasetBuilder):
    """Train (and optional test) split of a built-in task (`dsv4flash.tasks.TASKS`), tokenised with
    `get_tokenizer(model_name_for_tokenizer)`."""

    model_name_for_tokenizer: str
    task: str = "arithmetic"
    batch_size: int = 4
    n_batches: int = 8
    test_examples: int = 0
    seed: int = 0

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        """Build the datasets (text tasks only: the cookbook datum here carries no image chunks)."""
        if self.batch_size < 1 or self.n_batches < 1:
            raise ValueError(f"TaskSupervisedDatasetBuilder: batch_size and n_batches must be ≥ 1, got "
                             f"{self.batch_size} and {self.n_batches}")
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        train = [task_datum(tokenizer, task_example(self.task, self.seed, 0, i))
                 for i in range(self.batch_size * self.n_batches)]
        test = [task_datum(tokenizer, task_example(self.task, self.seed, 1, i)) for i in range(self.test_examples)]
        return (TaskSupervisedDataset(train, self.batch_size),
                TaskSupervisedDataset(test, len(test)) if test else None)
