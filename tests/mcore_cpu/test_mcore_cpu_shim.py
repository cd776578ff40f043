"""The test-only CUDA redirect lets real megatron-core modules run on CPU, and leaves no trace afterwards."""

from __future__ import annotations

import json

import pytest
import torch

from tests.mcore_cpu import models, parallel, shim

pytestmark = [pytest.mark.upstream, pytest.mark.whole_machine]


def test_install_redirects_and_uninstall_restores():
    originals = {name: getattr(torch, name) for name in ("zeros", "arange", "randn_like")}
    current_device, tensor_cuda = torch.cuda.current_device, torch.Tensor.cuda
    with shim.cuda_redirect():
        assert shim.installed()
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(3, device="cuda").device.type == "cpu"
        assert torch.arange(4, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
        torch.manual_seed(7)
        assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())
        event = torch.cuda.current_stream().record_event()
        event.synchronize()  # the dispatcher's d2h sync must be a harmless no-op
        with shim.cuda_redirect():  # nested use neither reinstalls nor uninstalls
            assert shim.installed()
        assert shim.installed()
    assert not shim.installed()
    assert torch.cuda.current_device is current_device and torch.Tensor.cuda is tensor_cuda
    assert all(getattr(torch, name) is fn for name, fn in originals.items())


def test_device_contexts_build_on_meta_during_and_after_the_redirect():
    """`with torch.device("meta")` keeps working while the factories are wrapped and after they are restored,
    even when torch first builds its set of device-aware constructors inside the redirect (this leaked: a meta
    build after the mbridge tests allocated real tensors)."""
    from torch.utils._device import _device_constructors

    _device_constructors.cache_clear()
    with shim.cuda_redirect():
        with torch.device("meta"):
            inside = torch.nn.Linear(4, 4)
        assert inside.weight.is_meta and torch.empty(2, device="meta").is_meta
    with torch.device("meta"):
        after = torch.nn.Linear(4, 4)
    assert after.weight.is_meta
    assert torch.empty in _device_constructors()  # the original, not a wrapper


def test_offload_and_torch_adam_load_fixes_install_and_restore():
    """The optimizer pieces of the CPU mode: pinning, the offload split, torch-Adam's resharding load."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    names = ("sharded_state_dict", "_set_main_param_and_optimizer_states", "load_state_dict")
    originals = {name: getattr(DistributedOptimizer, name) for name in names}
    split, pin = HybridDeviceOptimizer._get_sub_optimizer_param_groups, torch.Tensor.pin_memory
    with shim.cuda_redirect():
        t = torch.ones(3)
        assert t.pin_memory() is t and torch.empty(2, pin_memory=True).device.type == "cpu"
        param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        hdo = HybridDeviceOptimizer([param], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                                    gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True, lr=0.5)
        (host,) = hdo.gpu_params_map_cpu_copy.values()  # the parameter counts as the device copy
        assert host.dtype == torch.float32 and host.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
        assert hdo.gpu_optimizer is None and not param.is_cuda  # is_cuda is reported only during the split
        param.grad = torch.ones(4, dtype=torch.bfloat16)
        hdo.step()
        assert bool((param < 1).all()), "the host step's result was not copied back to the parameter"
        assert all(getattr(DistributedOptimizer, name) is not fn for name, fn in originals.items())
    assert all(getattr(DistributedOptimizer, name) is fn for name, fn in originals.items())
    assert HybridDeviceOptimizer._get_sub_optimizer_param_groups is split and torch.Tensor.pin_memory is pin
    assert "is_cuda" not in torch.Tensor.__dict__


def test_cuda_rng_fork_runs_on_the_cpu_stream_and_restores_it(mcore_parallel):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    torch.manual_seed(0)
    expected_outer = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        first_fork_draw = torch.rand(5)
    assert torch.equal(torch.rand(3), expected_outer), "fork must restore the outer (default) stream"
    with tracker.fork():
        second_fork_draw = torch.rand(5)
    assert not torch.equal(first_fork_draw, second_fork_draw), "the forked stream must advance, not restart"


def test_real_topk_router_forward(mcore_parallel):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    config = models.tiny_moe_config()
    router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    assert router.expert_bias.device.type == "cpu"
    hidden = torch.randn(6, 2, config.hidden_size)  # [s, b, h]
    probs, routing_map = router(hidden)
    assert probs.shape == routing_map.shape == (12, config.num_moe_experts)  # [s*b, E]
    assert routing_map.sum(dim=1).eq(config.moe_router_topk).all()
    assert torch.equal(router.local_tokens_per_expert, routing_map.sum(dim=0).float())


def _train_step(config) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One fwd+bwd of a fresh tiny GPT MoE (seeded); returns the logits and named grads."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(11)
    model_parallel_cuda_manual_seed(11, force_reset_rng=True)
    model = models.tiny_gpt_moe(config)
    logits = model(**models.gpt_inputs(batch=2, seq_len=8))  # [b, s, vocab]
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_gpt_moe_forward_backward(mcore_parallel, dispatcher):
    logits, grads = _train_step(models.tiny_moe_config(moe_token_dispatcher_type=dispatcher))
    assert logits.shape == (2, 8, 64) and torch.isfinite(logits).all()
    router_grads = [g for n, g in grads.items() if n.endswith("router.weight")]
    expert_grads = [g for n, g in grads.items() if ".experts." in n]
    assert len(router_grads) == 2 and all(g.abs().sum() > 0 for g in router_grads)
    assert expert_grads and all(torch.isfinite(g).all() for g in expert_grads)


def test_full_recompute_gives_the_same_gradients(mcore_parallel):
    plain_logits, plain = _train_step(models.tiny_moe_config(hidden_dropout=0.1))
    recompute_logits, recomputed = _train_step(models.tiny_moe_config(
        hidden_dropout=0.1, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    torch.testing.assert_close(recompute_logits, plain_logits, rtol=0, atol=0)
    assert plain.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


def _two_rank_tp_linear(rank: int, world_size: int, out_dir: str) -> None:
    """Rank body: a column-parallel linear over TP=2 must equal the unsharded matmul."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    with parallel.model_parallel(tp=2, rank=rank, world_size=world_size):
        config = models.tiny_moe_config(tensor_model_parallel_size=2)
        torch.manual_seed(0)
        full_weight = torch.randn(8, 6)  # [out, in], identical on both ranks
        layer = ColumnParallelLinear(6, 8, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                     gather_output=True)
        shard = full_weight.chunk(2, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
        layer.weight.data.copy_(shard)
        x = torch.randn(3, 6)
        y, _ = layer(x)
        result = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
                  "max_err": (y - x @ full_weight.T).abs().max().item()}
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(result, fh)


def test_spawned_gloo_ranks_run_tensor_parallel(tmp_path):
    parallel.spawn_gloo(_two_rank_tp_linear, 2, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["tp"] == 2 for r in results)
    assert all(r["max_err"] < 1e-6 for r in results)


def _rank1_fails(rank: int, world_size: int) -> None:
    """Rank 1 raises while rank 0 waits in a collective it can never finish."""
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    torch.distributed.barrier()


def test_a_failing_rank_is_reported_and_the_others_stopped():
    with pytest.raises(RuntimeError, match="gloo-rank1 exit code 1"):
        parallel.spawn_gloo(_rank1_fails, 2)


@pytest.mark.parametrize("distributed", [False, True], ids=["fp32_optimizer", "distributed_optimizer"])
def test_megatron_optimizers_step_host_parameters(mcore_parallel, distributed):
    """megatron-core's optimizers dispatch on `param.type()` naming CUDA: under the redirect they take fp32 host
    parameters, while every other caller still sees the host type name."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = models.tiny_moe_config()
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed, grad_reduce_in_fp32=True),
        models.tiny_gpt_moe(config))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed),
                                       [model])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model(**models.gpt_inputs(2, 8)).float().mean().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert next(model.parameters()).type() == "torch.FloatTensor"  # not the optimizer asking
