"""Fixtures of the training tests: one intra-op thread (the tiny model's ops are small; a second thread
only adds contention), and a small seeded tiny model."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
