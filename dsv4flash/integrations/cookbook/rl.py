"""A cookbook `RLDatasetBuilder` over a built-in task: one-step environments scored by the task's reward."""

from __future__ import annotations

from collections.abc import Sequence

import chz
import tinker
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import get_tokenizer

from dsv4flash.integrations.cookbook.common import encode_prompt, task_example


class TaskEnv(Env):
    """One problem: observe bos + prompt, answer until eos, reward = the task's verifier on the decoded text."""

    def __init__(self, task_name: str, example, tokenizer) -> None:
        from dsv4flash.tasks import build_task

        self.task, self.example, self.tokenizer = build_task(task_name), example, tokenizer

    async def initial_observation(self):
        """The prompt, and eos as the stop condition."""
        return (tinker.ModelInput.from_ints(encode_prompt(self.tokenizer, self.example.prompt)),
                [int(self.tokenizer.eos_token_id)])

    async def step(self, action, *, extra=None) -> StepResult:
        """Score the sampled answer; one step per episode."""
        from dsv4flash.tasks.text_tokenizer import decode_task_text

        # The task's own text form ("19", "red circle"): the served decode joins tokens without spaces.
        text = decode_task_text(self.tokenizer, action)
        reward = float(self.task.reward(self.example, text))
        return StepResult(reward=reward, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=[], metrics={"correct": reward})


class TaskEnvGroupBuilder(EnvGroupBuilder):
    """`group_size` copies of one problem (GRPO centres rewards over the group); picklable: names only."""

    def __init__(self, task_name: str, seed: int, split: int, index: int, group_size: int, model_name: str) -> None:
        self.task_name, self.seed, self.split, self.index = task_name, seed, split, index
        self.group_size, self.model_name = group_size, model_name

    async def make_envs(self) -> Sequence[Env]:
        """The group's environments (tokenizer and example built here, not pickled)."""
        tokenizer = get_tokenizer(self.model_name)
        example = task_example(self.task_name, self.seed, self.split, self.index)
        return [TaskEnv(self.task_name, example, tokenizer) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        """Metrics are also reported per task."""
        return [self.task_name]


class TaskRLDataset(RLDataset):
    """`n_batches` batches of `groups_per_batch` problem groups."""

    def __init__(self, builders: list[TaskEnvGroupBuilder], groups_per_batch: int) -> None:
        self.builders, self.groups_per_batch = builders, groups_per_batch

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        """The groups of batch `index`."""
        return self.builders[index * self.groups_per_batch:(index + 1) * self.groups_per_batch]

    def __len__(self) -> int:
        return len(self.builders) // self.groups_per_batch


@chz.chz
class TaskRLDatasetBuilder(RLDatasetBuilder):
    """RL problems of a built-in task (`dsv4flash.tasks.TASKS`, text tasks), tokenised with
    `get_tokenizer(model_name_for_tokenizer)`."""

    model_name_for_tokenizer: str
    task: str = "arithmetic"
    groups_per_batch: int = 2
    group_size: int = 4
    n_batches: int = 4
    test_groups: int = 0
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        """Build the train (and optional test) datasets."""
        if min(self.groups_per_batch, self.group_size, self.n_batches) < 1:
            raise ValueError(f"TaskRLDatasetBuilder: groups_per_batch, group_size and n_batches must be ≥ 1, got "
                             f"{self.groups_per_batch}, {self.group_size}, {self.n_batches}")

        def groups(split: int, n: int) -> list[TaskEnvGroupBuilder]:
            return [TaskEnvGroupBuilder(self.task, self.seed, split, i, self.group_size, self.model_name_for_tokenizer)
                    for i in range(n)]

        train = TaskRLDataset(groups(0, self.groups_per_batch * self.n_batches), self.groups_per_batch)
        test = TaskRLDataset(groups(1, self.test_groups), self.test_groups) if self.test_groups else None
        return train, test
