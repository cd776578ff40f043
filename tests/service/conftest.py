"""One resident tiny base per test module (building it is the slow part)."""

import pytest
import torch

from dsv4flash.service.resident import ResidentBase


@pytest.fixture(scope="module")
def resident():
    torch.set_num_threads(1)
    return ResidentBase("tiny", seed=0)
