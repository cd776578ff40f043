"""One real-CUDA Megatron session (no CPU redirect): a one-rank NCCL group and model-parallel state, TF32 off."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch


@contextlib.contextmanager
def single_gpu_megatron(seed: int = 1234):
    """NCCL on GPU 0, `initialize_model_parallel(1, 1)`, Megatron's CUDA RNG seeded; fp32 matmuls without TF32."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(seed)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
