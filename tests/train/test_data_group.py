"""The data group replaces the task mixture (Hydra merges dicts: a schema default would stay in every mixture)."""

from __future__ import annotations

import pytest

from dsv4flash.train.compose import compose


@pytest.mark.parametrize("recipe, overrides, tasks", [
    (None, [], {"geometry": 1.0}),
    ("decoder_lora", ["data=arithmetic"], {"arithmetic": 1.0}),
    ("decoder_lora_verl_cpu", [], {"arithmetic": 1.0}),
    ("decoder_lora", [], {"geometry": 1.0}),
])
def test_the_data_group_alone_sets_the_tasks(recipe, overrides, tasks):
    assert dict(compose(recipe, overrides).data.tasks) == tasks
