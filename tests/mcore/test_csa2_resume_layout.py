"""Resume across layouts with megatron-core's distributed checkpointing (LoRA adapter + Adam, full recompute).

1. A PP = 1 run (plain optimizer) checkpoints and a PP = 2 run loads it: the next step is bit-identical to
   the uninterrupted PP = 1 run (PP is bit-exact against PP = 1).
2. A CP = 2 run with megatron-core's *distributed* optimizer (Adam state sharded over the 2 dp × cp ranks)
   checkpoints in the `fully_reshardable` format and a PP = 2 run (dp × cp = 1: each stage holds its
   layers' whole state) loads it, so the optimizer state is resharded 2 → 1. CP changes the fp32 summation
   order (test_csa2_cp.py), so a CP step and a non-CP step differ in the last bits and no CP = 2 → PP = 2
   resume can equal a CP = 2 run continued at CP = 2. The uninterrupted run it must equal bit for bit is
   therefore the same CP = 2 → PP = 2 run switching layout *in memory*: the CP ranks' adapters and their
   Adam shards gathered by hand (not by megatron-core's checkpoint code) and handed to the PP stages. A
   fresh optimizer with the loaded adapters must differ (the comparison sees the optimizer state).

Both runs build the same model (tiny, reference weights, a Megatron-Bridge LoRA on every layer with values
seeded by global name), wrap it in megatron-core's DDP and optimizer (`get_megatron_optimizer`), and take
the same micro-batches through megatron-core's schedules; each PP = 2 stage loads its own layers' part.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from dsv4flash.integrations.mcore.csa2.weights import global_name
from tests.mcore import csa2_support as sup
from tests.mcore.layout_matrix import LAYOUT
from tests.mcore_cpu import parallel

pytestmark = [pytest.mark.upstream, pytest.mark.parity, pytest.mark.whole_machine]

SEQ, MICROBATCHES, STEPS = 16, 2, 2
TARGETS = ["linear_q_down", "linear_kv", "linear_proj", "linear_o_group_proj"]




def _build(pipeline: bool, distributed: bool = False):
    """Model (DDP-wrapped), optimizer and the inner model for this rank (`distributed`: megatron-core's
    distributed optimizer, state sharded over the dp × cp ranks)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dsv4flash.integrations.mcore.csa2 import DSV41ModelProvider, load_reference_state
    from tests.mbridge import shim

    shim.install()
    from dsv4flash.integrations import mbridge

    ref = sup.reference(seed=0)
    overrides = dict(pipeline_dtype=torch.float32, variable_seq_lengths=True) if pipeline else {}
    model = DSV41ModelProvider(ref.cfg, recompute="full", overrides=overrides).provide()
    load_reference_state(model, ref.state_dict())
    model = mbridge.DSV41LoRA(target_modules=TARGETS, dim=4, alpha=8)(model, training=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".adapter." in name:
                gen = torch.Generator().manual_seed(zlib.crc32(global_name(name, model).encode()))
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32,
                                                       use_distributed_optimizer=distributed), [ddp])
    return ddp, optimizer, model


def _batches(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, sup.VOCAB, (1, SEQ + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _step(ddp, optimizer, step: int) -> list[float]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=_batches(step), model=[ddp],
                                         num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1,
                                         forward_only=False)
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    return [float(x["loss"]) for x in losses]


def _adapters(model) -> dict[str, torch.Tensor]:
    return {global_name(n, model): p.detach().clone() for n, p in model.named_parameters() if ".adapter." in n}


def _sharded(ddp, optimizer, is_loading: bool = False, metadata: dict | None = None):
    """Model + optimizer sharded state: Adam moments are keyed like the parameters they belong to, so
    another model-parallel layout loads them."""
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                         metadata=metadata)}


def _resume_rank(rank: int, world_size: int, ckpt: str, expected_path: str) -> None:
    from megatron.core import dist_checkpointing

    from tests.mcore.test_engram_pinned import cuda_type_names

    torch.set_num_threads(1)
    expected = torch.load(expected_path)
    with cuda_type_names(), parallel.model_parallel(pp=world_size, rank=rank, world_size=world_size, seed=3):
        ddp, optimizer, model = _build(pipeline=True)
        state = dist_checkpointing.load(_sharded(ddp, optimizer, is_loading=True), ckpt)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        losses = _step(ddp, optimizer, STEPS - 1)
        if rank == world_size - 1:
            assert losses == expected["losses"]
        got = _adapters(model)
        assert got
        for name, value in got.items():
            assert torch.equal(value, expected["adapters"][name]), f"stage {rank} {name}: differs after resume"


@pytest.mark.slow
@LAYOUT(pp=2, recompute="full", check="checkpoint at PP = 1 (adapter + Adam state, megatron-core "
        "dist_checkpointing), resumed at PP = 2: "
        "the next step's loss and adapters bit-identical to the uninterrupted run")
def test_adapter_checkpoint_resumes_bit_identically_at_another_layout(tmp_path):
    from megatron.core import dist_checkpointing

    from tests.mcore.test_engram_pinned import cuda_type_names

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with sup.single_thread(), cuda_type_names(), parallel.model_parallel(seed=3):
        ddp, optimizer, model = _build(pipeline=False)
        for step in range(STEPS - 1):
            _step(ddp, optimizer, step)
        dist_checkpointing.save(_sharded(ddp, optimizer), str(ckpt))
        losses = _step(ddp, optimizer, STEPS - 1)  # the uninterrupted run
        expected = {"losses": losses, "adapters": _adapters(model)}
    path = tmp_path / "expected.pt"
    torch.save(expected, path)
    with sup.single_thread():
        parallel.spawn_gloo(_resume_rank, 2, str(ckpt), str(path), timeout=600)


RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def _cp_forward_step(data_iterator, model):
    """This CP rank's zigzag share of the micro-batch; the loss is its share of the global token mean."""
    batch = next(data_iterator)
    local = model.module.decoder.cp_positions(SEQ // 2)
    output = model(batch["tokens"][:, local], labels=batch["labels"][:, local])

    def loss_func(per_token_loss):
        # megatron-core's schedule multiplies by the CP size and its DDP averages over dp × cp: the
        # gradient is that of the mean over all SEQ tokens.
        loss = per_token_loss.float().sum() / SEQ
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _cp_step(ddp, optimizer, step: int) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=_cp_forward_step, data_iterator=_batches(step), model=[ddp],
                                num_microbatches=MICROBATCHES, seq_length=SEQ // 2, micro_batch_size=1,
                                forward_only=False)
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok


def _local_ranges(distributed) -> dict:
    """Model parameter -> its range map, for the parameters with elements in this rank's optimizer shard."""
    return {param: ranges for gbuf_range_maps in distributed.gbuf_ranges for per_dtype in gbuf_range_maps.values()
            for bucket in per_dtype for param, ranges in bucket["param_map"].items()}


def _full_optimizer_state(optimizer, model) -> tuple[dict, float]:
    """Every parameter's whole Adam state (fp32 main param, moments) by global name, gathered by hand from
    the distributed optimizer's dp × cp shards (disjoint ranges summed with zeros), and the step count."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    (distributed,) = optimizer.chained_optimizers
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    local = _local_ranges(distributed)
    state = {}
    for name, param in sorted((global_name(n, model), p) for n, p in model.named_parameters() if p.requires_grad):
        full = {key: torch.zeros(param.numel()) for key in ("param", "exp_avg", "exp_avg_sq")}
        if param in local:
            start, end = local[param]["param"].start, local[param]["param"].end
            shards = distributed._get_main_param_and_optimizer_states(param)  # + torch Adam's scalar "step"
            for key in full:
                full[key][start:end] = shards[key]
        for key in sorted(full):  # the same names and keys on every rank: one all-reduce each
            dist.all_reduce(full[key], group=group)
        state[name] = full
    (step,) = {float(s["step"]) for s in distributed.optimizer.state.values()}
    return state, step


def _set_full_optimizer_state(optimizer, model, state: dict, step: float) -> None:
    """The in-memory layout switch: give this stage's distributed optimizer its parameters' whole state."""
    (distributed,) = optimizer.chained_optimizers
    distributed._init_optimizer_states_with_dummy_values()
    names = {param: global_name(n, model) for n, param in model.named_parameters()}
    with torch.no_grad():
        for param, ranges in _local_ranges(distributed).items():
            start, end = ranges["param"].start, ranges["param"].end
            shard = {k: v[start:end] for k, v in state[names[param]].items()}
            distributed._set_main_param_and_optimizer_states(param, {**shard, "step": torch.tensor(step)})


def _cp_then_pp_rank(rank: int, world_size: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing

    from tests.mcore.test_engram_pinned import cuda_type_names

    torch.set_num_threads(1)
    with cuda_type_names():
        with parallel.model_parallel(cp=world_size, rank=rank, world_size=world_size, seed=3):
            ddp, optimizer, model = _build(pipeline=False, distributed=True)
            (distributed,) = optimizer.chained_optimizers
            assert distributed.data_parallel_group.size() == world_size, "the optimizer state is not CP-sharded"
            for step in range(STEPS - 1):
                _cp_step(ddp, optimizer, step)
            dist_checkpointing.save(_sharded(ddp, optimizer, metadata=RESHARDABLE), ckpt)
            adapters = _adapters(model)
            state, step_count = _full_optimizer_state(optimizer, model)
        with parallel.model_parallel(pp=world_size, rank=rank, world_size=world_size, seed=3):
            # Uninterrupted: the CP run's state handed to the PP stages in memory.
            ddp, optimizer, model = _build(pipeline=True, distributed=True)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".adapter." in name:
                        param.copy_(adapters[global_name(name, model)])
            _set_full_optimizer_state(optimizer, model, state, step_count)
            want_losses = _step(ddp, optimizer, STEPS - 1)
            want = _adapters(model)
            # Resumed: the same stages from the checkpoint (adapters + resharded distributed Adam).
            ddp, optimizer, model = _build(pipeline=True, distributed=True)
            loaded = dist_checkpointing.load(_sharded(ddp, optimizer, is_loading=True, metadata=RESHARDABLE), ckpt)
            model.load_state_dict(loaded["model"], strict=False)
            optimizer.load_state_dict(loaded["optimizer"])
            losses = _step(ddp, optimizer, STEPS - 1)
            got = _adapters(model)
            assert losses == want_losses
            assert got.keys() == want.keys() and got
            for name, value in got.items():
                assert torch.equal(value, want[name]), f"stage {rank} {name}: the resumed step differs"
            # Control: the adapters alone, with a fresh optimizer, do not continue the run.
            ddp, optimizer, model = _build(pipeline=True, distributed=True)
            loaded = dist_checkpointing.load({"model": ddp.module.sharded_state_dict()}, ckpt)
            model.load_state_dict(loaded["model"], strict=False)
            _step(ddp, optimizer, STEPS - 1)
            assert any(not torch.equal(v, want[n]) for n, v in _adapters(model).items()), \
                "a fresh optimizer continued identically: the comparison cannot see the optimizer state"


@pytest.mark.slow
@LAYOUT(pp=2, recompute="full", check="checkpoint at CP = 2 (adapter + distributed Adam sharded over the 2 CP "
        "ranks, `fully_reshardable`), resumed at PP = 2 (the row: the layout resumed at; dp × cp 2 → 1): the next "
        "step's loss and adapters bit-identical to the same CP = 2 → PP = 2 run switching layout in memory")
def test_context_parallel_checkpoint_resumes_bit_identically_at_pipeline_parallel(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with sup.single_thread():
        parallel.spawn_gloo(_cp_then_pp_rank, 2, str(ckpt), timeout=600)
