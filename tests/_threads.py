"""One intra-op thread for a block of tiny-model work: its ops are far too small for torch's thread pool, and on a
busy 2-core runner a second thread only spins."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch.set_num_threads(1) for the block, the previous count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
