"""CPU-pinned Engram: host table outside parameters(), equal to the reference layer, untouched by DDP (gloo).

On this CPU machine the table is plain host memory (pinning needs CUDA); the code path is the same.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.nn.functional as F

from dsv4flash.integrations.mcore.engram import (
    HostTable,
    PinnedEngram,
    SparseRowSGD,
    dequantize_rows_e8m0,
    quantize_rows_e8m0,
)
from dsv4flash.model.engram import Engram, EngramHasher
from tests.mcore_cpu import parallel as mcore_parallel

pytestmark = pytest.mark.whole_machine  # multi-rank gloo runs (tests/_scheduling.py)

LAYER = 1  # the second tiny Engram layer (630 rows)


# ---- builders (module level: the DDP ranks import them) --------------------------------------------
def reference_and_pinned(cfg, seed: int, **pinned_kwargs):
    """A reference Engram and a PinnedEngram loaded from its state dict (strict: same keys)."""
    torch.manual_seed(seed)
    ref = Engram(cfg, LAYER)
    with torch.no_grad():
        ref.q_weight.normal_(1.0, 0.2)  # make the gate weights matter
        ref.k_weight.normal_(1.0, 0.2)
    pinned = PinnedEngram(cfg, LAYER, **pinned_kwargs)
    pinned.load_state_dict(ref.state_dict(), strict=True)
    return ref, pinned


def engram_batch(cfg, seed: int, batch: int = 2, seq: int = 24):
    """Streams x [B,S,hc,D], hashed row ids [B,S,n_cols] (with an image span) and the token mask [B,S]."""
    gen = torch.Generator().manual_seed(seed)
    text = cfg.text
    ids = torch.randint(0, text.vocab_size, (batch, seq), generator=gen)
    types_ = torch.full((batch, seq), -1)
    types_[0, 5:9] = 0  # an image span: rows hashed as DEAD, gate forced to 0
    rows = EngramHasher(cfg)(ids, types_)[LAYER]
    x = torch.randn(batch, seq, text.hc_mult, text.hidden_size, generator=gen)
    return x, rows, types_ < 0


def table_checksum(table: HostTable) -> float:
    return float(table.weight.double().sum())


# ---- single process ----------------------------------------------------------------------------
def test_forward_and_grads_equal_the_reference(tiny_cfg):
    ref, pinned = reference_and_pinned(tiny_cfg, seed=0)
    x, rows, mask = engram_batch(tiny_cfg, seed=1)
    outs = []
    for module in (ref, pinned):
        xi = x.clone().requires_grad_()
        out = module(xi, rows, mask)
        out.square().sum().backward()
        outs.append((out, xi.grad, module.wkv.weight.grad, module.q_weight.grad, module.k_weight.grad))
    for want, got in zip(*outs):
        assert torch.equal(got, want)
    assert ref.embed.weight.grad is not None  # the reference trains its table; the pinned one is frozen
    assert not pinned.table.weight.requires_grad and pinned.table.weight.grad is None


def test_table_is_outside_parameters_buffers_and_apply(tiny_cfg):
    _, pinned = reference_and_pinned(tiny_cfg, seed=2)
    table = pinned.table.weight
    ptr, before = table.data_ptr(), table.clone()
    names = {n for n, _ in pinned.named_parameters()} | {n for n, _ in pinned.named_buffers()}
    assert names == {"wkv.weight", "q_weight", "k_weight"}
    assert all(p.data_ptr() != ptr for p in pinned.parameters())
    seen = []

    def spy(t):  # what `.cuda()`, `.to()`, `.half()` and Float16Module's `.bfloat16()` apply to every tensor
        seen.append(t.data_ptr())
        return t.to(torch.bfloat16)

    pinned._apply(spy)
    pinned.to(torch.float64)
    assert ptr not in seen and len(seen) == 3
    assert pinned.wkv.weight.dtype == torch.float64
    assert pinned.table.weight is table and table.dtype == torch.float32 and torch.equal(table, before)


def test_state_dict_roundtrip_keeps_the_host_tensor(tiny_cfg):
    ref, pinned = reference_and_pinned(tiny_cfg, seed=3)
    assert set(pinned.state_dict()) == set(ref.state_dict())
    table = pinned.table.weight
    new = {k: v.clone() for k, v in ref.state_dict().items()}
    new["embed.weight"].mul_(2)
    pinned.load_state_dict(new)
    assert pinned.table.weight is table and torch.equal(table, new["embed.weight"])
    bad = dict(new, **{"embed.weight": torch.zeros(5, tiny_cfg.text.engram_head_dim)})
    expected = r"embed.weight: expected torch.float32 \[630, 64\].*got torch.float32 \[5, 64\]"
    with pytest.raises(RuntimeError, match=expected):
        pinned.load_state_dict(bad)
    missing = {k: v for k, v in new.items() if k != "embed.weight"}
    with pytest.raises(RuntimeError, match="Missing key.*embed.weight"):
        pinned.load_state_dict(missing)


def test_gather_moves_each_distinct_row_once(tiny_cfg):
    _, pinned = reference_and_pinned(tiny_cfg, seed=4)
    ids = torch.tensor([[3, 7, 3], [629, 7, 0]])
    want = F.embedding(ids, pinned.table.weight)
    assert torch.equal(pinned.table.gather(ids, dedup=True), want)  # distinct ids to the host, expanded after
    stats = pinned.table.stats
    assert (stats.requested, stats.unique, stats.bytes_moved) == (6, 4, 4 * 64 * 4)
    assert torch.equal(pinned.table.gather(ids, dedup=False), want)  # every id on its own
    assert (pinned.table.stats.requested, pinned.table.stats.unique) == (6, 6)
    # Default on the host, float rows: nothing crosses a bus or is decoded, so one plain gather of every id.
    assert torch.equal(pinned.lookup_rows(ids), want) and pinned.table.stats.unique == 6
    pinned.table.dedup = True  # the table-wide setting
    assert torch.equal(pinned.lookup_rows(ids), want) and pinned.table.stats.unique == 4
    with pytest.raises(ValueError, match=r"Engram layer 4 table: row ids must lie in \[0, 630\), got range \[0, 630\]"):
        pinned.lookup_rows(torch.tensor([0, 630]))
    with pytest.raises(ValueError, match="int32/int64"):
        pinned.lookup_rows(torch.tensor([0.0]))


def test_fp8_table_dequantizes_on_the_device_side(tiny_cfg):
    ref, _ = reference_and_pinned(tiny_cfg, seed=5)
    values, scale = quantize_rows_e8m0(ref.embed.weight.detach())
    # Written straight from the format: float(e4m3) · 2^(e8m0 − 127), one scale per 32 lanes.
    manual = values.float() * torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    assert (manual - ref.embed.weight).abs().max() <= ref.embed.weight.abs().max() / 8  # E4M3: 3 mantissa bits
    torch.testing.assert_close(dequantize_rows_e8m0(values, scale, torch.float32), manual, rtol=0, atol=0)
    fp8 = PinnedEngram(tiny_cfg, LAYER, table_dtype=torch.float8_e4m3fn)
    sd = {k: v for k, v in ref.state_dict().items() if k != "embed.weight"}
    fp8.load_state_dict(dict(sd, **{"embed.weight": values, "embed.scale": scale}))
    assert fp8.table.row_bytes == 64 + 2
    with torch.no_grad():
        ref.embed.weight.copy_(manual)  # the reference on the dequantized table
    x, rows, mask = engram_batch(tiny_cfg, seed=6)
    assert torch.equal(fp8(x, rows, mask), ref(x, rows, mask))
    for dedup in (False, True, None):
        got_values, got_scale = fp8.table.gather_stored(rows, dedup=dedup)
        assert torch.equal(got_values.view(torch.uint8), values[rows].view(torch.uint8))
        assert torch.equal(got_scale, scale[rows])
        assert torch.equal(fp8.table.gather(rows, torch.float32, dedup=dedup), manual[rows])
        # Into preallocated results (reused: the old contents must not leak through)
        out_values = torch.full((*rows.shape, values.shape[1]), 7.0).to(torch.float8_e4m3fn)
        out_scale = torch.full((*rows.shape, scale.shape[1]), 9, dtype=torch.uint8)
        got_values, got_scale = fp8.table.gather_stored(rows, dedup=dedup, out=(out_values, out_scale))
        assert got_values.data_ptr() == out_values.data_ptr() and got_scale.data_ptr() == out_scale.data_ptr()
        assert torch.equal(out_values.view(torch.uint8), values[rows].view(torch.uint8))
        assert torch.equal(out_scale, scale[rows])
        out_rows = torch.full((*rows.shape, values.shape[1]), 5.0)
        got = fp8.table.gather(rows, torch.float32, dedup=dedup, out=out_rows)
        assert got.data_ptr() == out_rows.data_ptr() and torch.equal(out_rows, manual[rows])
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.uint8 \[.*\] tensor on cpu, got torch.int64"):
        fp8.table.gather_stored(rows, out=(out_values, torch.zeros(*rows.shape, scale.shape[1], dtype=torch.long)))
    # int32 ids go to index_select as they are (no int64 copy); the same bits, and a bad id is still named
    # (the host gather's own bounds check, no separate range pass, including negative ids).
    i32 = rows.to(torch.int32)
    got_values, got_scale = fp8.table.gather_stored(i32, out=(out_values, out_scale))
    assert torch.equal(got_values.view(torch.uint8), values[rows].view(torch.uint8)) and torch.equal(got_scale, scale[rows])
    assert torch.equal(fp8.table.gather(i32, torch.float32, dedup=False), manual[rows])
    n = fp8.table.rows
    for bad in (torch.tensor([[0, n]]), torch.tensor([[-1, 3]], dtype=torch.int32)):
        for dedup in (False, True):
            with pytest.raises(ValueError, match=rf"row ids must lie in \[0, {n}\), got range \[{int(bad.min())}, "):
                fp8.table.gather_stored(bad, dedup=dedup)


def test_megatron_constructor_and_spec_slot(tiny_cfg):
    config = types.SimpleNamespace(dsv4=tiny_cfg, params_dtype=torch.float32)
    module = PinnedEngram(config, 0, layer_number=2)
    assert module.layer_id == tiny_cfg.text.engram_layer_ids[0] and module.table.rows == 462
    assert "table=host[float32]" in repr(module)


def test_bad_tables_are_rejected():
    with pytest.raises(ValueError, match="needs its E8M0 `scale`"):
        HostTable(torch.zeros(4, 32, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"scale must be uint8 \[4, 1\]"):
        HostTable(torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="FP8 tables stay frozen"):
        HostTable(torch.zeros(4, 32, dtype=torch.float8_e4m3fn), torch.zeros(4, 1, dtype=torch.uint8),
                  trainable=True)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float8_e4m3fn])
def test_shared_table_file_one_copy_per_node(tiny_cfg, tmp_path, table_dtype):
    ref, _ = reference_and_pinned(tiny_cfg, seed=9)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    if table_dtype == torch.float8_e4m3fn:
        values, scale = quantize_rows_e8m0(state["embed.weight"])
        state.update({"embed.weight": values, "embed.scale": scale})
        with torch.no_grad():
            ref.embed.weight.copy_(dequantize_rows_e8m0(values, scale, torch.float32))
    template = str(tmp_path / "engram_{layer}.bin")
    with pytest.raises(ValueError, match=r"engram_4.bin must exist with 161280 bytes"):
        PinnedEngram(tiny_cfg, LAYER, table_file=template)  # nobody created it yet (630 x 64 fp32)
    owner = PinnedEngram(tiny_cfg, LAYER, table_file=template, create_table_file=True, table_dtype=table_dtype)
    owner.load_state_dict(state)
    # Another rank of the node attaches after the owner loaded: same pages, its own mapping, loads skip the table.
    peer = PinnedEngram(tiny_cfg, LAYER, table_file=template, table_dtype=table_dtype)
    assert peer.table.weight.data_ptr() != owner.table.weight.data_ptr()
    assert torch.equal(peer.table.weight.view(torch.uint8), owner.table.weight.view(torch.uint8))
    peer.load_state_dict(dict(state, **{"embed.weight": torch.zeros_like(state["embed.weight"])}))
    assert torch.equal(peer.table.weight.view(torch.uint8), owner.table.weight.view(torch.uint8))
    x, rows, mask = engram_batch(tiny_cfg, seed=10)
    assert torch.equal(peer(x, rows, mask), ref(x, rows, mask))
    with torch.no_grad():  # writes through one mapping are what every rank reads
        owner.table.weight.view(torch.uint8)[3].fill_(0)
    assert torch.equal(peer.lookup_rows(torch.tensor([3])), torch.zeros(1, 64, dtype=peer.lookup_rows(
        torch.tensor([3])).dtype))
    assert "shared" in repr(peer)
    if table_dtype == torch.float32:
        with pytest.raises(ValueError, match="sparse updates need a private table"):
            PinnedEngram(tiny_cfg, LAYER, table_file=template, trainable_table=True)


def dense_sgd_reference(cfg, state, batches, lr: float) -> torch.Tensor:
    """The reference table after one SGD step on the mean gradient of `batches` (one per data-parallel rank)."""
    ref = Engram(cfg, LAYER)
    ref.load_state_dict(state)
    grads = []
    for x, rows, mask in batches:
        ref.zero_grad()
        ref(x, rows, mask).square().mean().backward()
        grads.append(ref.embed.weight.grad.clone())
    return ref.embed.weight.detach() - lr * torch.stack(grads).mean(0)


@pytest.mark.parametrize("dedup", [False, True])
def test_sparse_row_sgd_equals_dense_sgd(tiny_cfg, dedup):
    ref, pinned = reference_and_pinned(tiny_cfg, seed=7, trainable_table=True)
    pinned.table.dedup = dedup
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    batch = engram_batch(tiny_cfg, seed=8)
    want = dense_sgd_reference(tiny_cfg, state, [batch], lr=0.5)
    opt = SparseRowSGD.for_module(pinned, lr=0.5)
    pinned(*batch).square().mean().backward()
    touched = torch.unique(batch[1])
    opt.step()
    torch.testing.assert_close(pinned.table.weight, want, rtol=1e-6, atol=1e-7)
    untouched = torch.ones(pinned.table.rows, dtype=torch.bool)
    untouched[touched] = False
    assert torch.equal(pinned.table.weight[untouched], state["embed.weight"][untouched])
    assert not torch.equal(pinned.table.weight[touched], state["embed.weight"][touched])
    with torch.no_grad():  # lookups under no_grad register nothing to train
        pinned(*batch)
    assert pinned.table.pop_row_grads()[0].numel() == 0


# ---- DDP + distributed optimizer over gloo (2 ranks) ------------------------------------------------
@contextlib.contextmanager
def cuda_type_names():
    """megatron-core's optimizers dispatch on `param.type() == 'torch.cuda.FloatTensor'`: report host tensors
    under their CUDA type name. A CUDA-redirect gap (tests/mcore_cpu/shim.py lacks it), confined to these ranks.
    """
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _ddp_rank(rank: int, world_size: int, flavour: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module, MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsv4flash.config import load_config
    from tests.mcore_cpu import parallel

    cfg = load_config(flavour)
    with cuda_type_names(), parallel.model_parallel(rank=rank, world_size=world_size, seed=1):
        config = TransformerConfig(num_layers=1, hidden_size=cfg.text.hidden_size, num_attention_heads=4,
                                   bf16=True, params_dtype=torch.float32, use_cpu_initialization=True)

        class Wrapper(MegatronModule):
            def __init__(self):
                super().__init__(config)
                self.engram = PinnedEngram(cfg, LAYER)

            def forward(self, x, rows, mask):
                return self.engram(x, rows, mask)

        torch.manual_seed(100 + rank)  # every tensor differs per rank until broadcast_params
        inner = Wrapper()
        table = inner.engram.table.weight
        ptr, snapshot = table.data_ptr(), table.clone()
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
            Float16Module(config, inner))
        model.broadcast_params()
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, use_distributed_optimizer=True), [model])

        x, rows, mask = engram_batch(cfg, seed=200 + rank)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = model(x.bfloat16(), rows, mask)
        out.float().square().mean().backward()
        model.finish_grad_sync()
        assert optimizer.step()[0]  # update succeeded

        # The table: same tensor, same dtype (the module is bf16 now), same values, never synchronised.
        assert inner.engram.table.weight is table and table.data_ptr() == ptr
        assert table.dtype == torch.float32 and torch.equal(table, snapshot)
        assert inner.engram.wkv.weight.dtype == torch.bfloat16
        params = list(model.parameters())
        assert all(p.data_ptr() != ptr for p in params)
        buffered = [p for buf in model.buffers + model.expert_parallel_buffers for p in buf.params]
        assert len(buffered) == 3 and all(p is not table for p in buffered)
        opt_params = [p for group in optimizer.param_groups for p in group["params"]]
        assert all(p is not table for p in opt_params)
        sums = [None] * world_size
        dist.all_gather_object(sums, (table_checksum(inner.engram.table), [float(p.float().sum()) for p in params]))
        assert sums[0][0] != sums[1][0]  # un-synced: each rank kept its own table
        assert sums[0][1] == sums[1][1]  # the parameters were broadcast and updated identically
        # Lookups on each rank still read exactly that rank's rows.
        assert torch.equal(inner.engram.lookup_rows(rows), F.embedding(rows, snapshot))

        # Opt-in sparse row training: identical tables everywhere, updated from the DP-mean row gradients.
        torch.manual_seed(300)
        ref, pinned = reference_and_pinned(cfg, seed=300, trainable_table=True)
        state = {k: v.clone() for k, v in ref.state_dict().items()}
        batches = [engram_batch(cfg, seed=400 + r) for r in range(world_size)]
        opt = SparseRowSGD.for_module(pinned, lr=0.5, dp_group=parallel_state.get_data_parallel_group())
        pinned(*batches[rank]).square().mean().backward()
        opt.step()
        want = dense_sgd_reference(cfg, state, batches, lr=0.5)
        torch.testing.assert_close(pinned.table.weight, want, rtol=1e-6, atol=1e-7)


def test_ddp_distributed_optimizer_leave_the_table_alone():
    mcore_parallel.spawn_gloo(_ddp_rank, 2, "tiny")


# ---- CUDA: pinned table, staged chunked copies (skipped without a GPU) -------------------------------
@pytest.mark.gpu
def test_cuda_gather_through_pinned_staging(tiny_cfg):
    gen = torch.Generator().manual_seed(11)
    table = HostTable(torch.randn(20000, 64, generator=gen))
    assert table.pinned and table.weight.is_pinned()
    for shape in [(4, 512, 6), (2, 9000, 6), (3, 7, 6)]:  # grow past one chunk, then shrink: staging reuse
        ids = torch.randint(0, 20000, shape, generator=gen)
        got = table.gather(ids.cuda())
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), F.embedding(ids, table.weight))
        assert table.stats.unique == torch.unique(ids).numel()
    values, scale = quantize_rows_e8m0(torch.randn(5000, 64, generator=gen))
    fp8 = HostTable(values, scale)
    ids = torch.randint(0, 5000, (3, 100, 6), generator=gen)
    got_values, got_scale = fp8.gather_stored(ids.cuda())
    assert torch.equal(got_values.cpu().view(torch.uint8), values[ids].view(torch.uint8))
    assert torch.equal(got_scale.cpu(), scale[ids])
    torch.testing.assert_close(fp8.gather(ids.cuda(), torch.float32).cpu(),
                               dequantize_rows_e8m0(values[ids], scale[ids], torch.float32), rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_module_keeps_its_table_on_the_host(tiny_cfg):
    ref, pinned = reference_and_pinned(tiny_cfg, seed=12, trainable_table=True)
    table = pinned.table.weight
    pinned.cuda()
    assert pinned.wkv.weight.is_cuda and pinned.table.weight is table and table.device.type == "cpu"
    x, rows, mask = engram_batch(tiny_cfg, seed=13)
    out = pinned(x.cuda(), rows.cuda(), mask.cuda())
    torch.testing.assert_close(out.cpu(), ref(x, rows, mask), rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    ids, grads = pinned.table.pop_row_grads()
    assert grads.device.type == "cpu" and torch.equal(ids, torch.unique(rows))


@pytest.mark.gpu
def test_cuda_shared_table_file_is_registered_in_place(tiny_cfg, tmp_path):
    values, scale = quantize_rows_e8m0(torch.randn(3000, 64, generator=torch.Generator().manual_seed(14)))
    owner = HostTable.from_file(tmp_path / "t.bin", 3000, 64, torch.float8_e4m3fn, create=True)
    owner.weight.copy_(values)
    owner.scale.copy_(scale)
    peer = HostTable.from_file(tmp_path / "t.bin", 3000, 64, torch.float8_e4m3fn)
    assert peer.pinned and peer.mapped_path and peer.skip_load
    ids = torch.randint(0, 3000, (4, 50, 6), generator=torch.Generator().manual_seed(15))
    got_values, got_scale = peer.gather_stored(ids.cuda())
    assert torch.equal(got_values.cpu().view(torch.uint8), values[ids].view(torch.uint8))
    assert torch.equal(got_scale.cpu(), scale[ids])


def test_cpu_row_dequantize_matches_the_definition():
    """The CPU fast path (bridge codec) gives float(v)·2^(s−127) exactly, for fp32/bf16 and any leading shape."""
    from dsv4flash.integrations.mcore.host_table import dequantize_rows_e8m0

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (3, 5, 64), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two E4M3 NaN codes are never stored
    values = codes.view(torch.float8_e4m3fn)
    scales = torch.randint(100, 150, (3, 5, 2), generator=gen, dtype=torch.uint8)
    want = (values.float().unflatten(-1, (2, 32)) * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_rows_e8m0(values, scales, dtype)
        assert got.shape == (3, 5, 64) and got.dtype == dtype
        assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("dtype,dim", [(torch.uint8, 8), (torch.float32, 2), (torch.bfloat16, 2), (torch.float16, 1),
                                       (torch.float32, 3)])
def test_element_view_gather_equals_the_plain_row_gather(dtype, dim):
    """Rows of 1/2/4/8 bytes go through one integer element each (torch's element kernel): the same bits as the
    plain row gather, into a fresh or a caller's buffer; other widths and non-contiguous tables keep the rows."""
    from dsv4flash.integrations.mcore.host_table import element_view, index_rows

    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 255, (50, dim * torch.empty(0, dtype=dtype).element_size()), dtype=torch.uint8,
                          generator=gen).view(dtype)
    ids = torch.randint(0, 50, (77,), generator=gen)
    elements = element_view(table)
    width = dim * table.element_size()
    assert (elements is None) == (width not in (1, 2, 4, 8))
    if elements is not None:
        assert elements.shape == (50,) and elements.data_ptr() == table.data_ptr()
    assert element_view(table.t()) is None if dim > 1 else True  # a transposed view is not row-contiguous
    want = torch.index_select(table, 0, ids).view(torch.uint8)
    assert torch.equal(index_rows(table, ids).view(torch.uint8), want)
    out = torch.empty(77, dim, dtype=dtype)
    assert index_rows(table, ids.to(torch.int32), out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out.view(torch.uint8), want)


@pytest.mark.parametrize("dtype,dim", [(torch.float8_e4m3fn, 64), (torch.float32, 2), (torch.float32, 64)])
def test_host_gather_into_caller_buffers(dtype, dim):
    """gather_stored(out=) on the host without dedup: one index_select per tensor into the caller's buffers,
    which come back as they are; bit-equal to plain indexing; bad ids, id dtypes and buffers refused by name."""
    from dsv4flash.integrations.mcore.host_table import HostTable

    gen = torch.Generator().manual_seed(1)
    rows = 300
    table = HostTable.empty(rows, dim, dtype, name="layer 3 table")
    table.weight.view(torch.uint8).copy_(torch.randint(0, 0x7F, table.weight.view(torch.uint8).shape,
                                                       dtype=torch.uint8, generator=gen))
    if table.fp8:
        table.scale.copy_(torch.randint(0, 255, table.scale.shape, dtype=torch.uint8, generator=gen))
    ids = torch.randint(0, rows, (5, 7, 3), generator=gen)
    values = torch.full((5, 7, 3, dim), 3).to(dtype)
    scales = torch.full((5, 7, 3, dim // 32), 9, dtype=torch.uint8) if table.fp8 else None
    for row_ids in (ids, ids.to(torch.int32)):
        got = table.gather_stored(row_ids, out=(values, scales))
        assert got[0] is values and got[1] is scales
        assert torch.equal(values.view(torch.uint8), table.weight[ids].view(torch.uint8))
        if table.fp8:
            assert torch.equal(scales, table.scale[ids])
        stats = table.stats
        assert (stats.requested, stats.unique, stats.bytes_moved) == (105, 105, 105 * table.row_bytes)
        deduped = table.gather_stored(row_ids, dedup=True)  # the deduplicating path gives the same bits
        assert torch.equal(deduped[0].view(torch.uint8), values.view(torch.uint8))
        assert table.stats.unique == torch.unique(ids).numel()
    for bad in (torch.tensor([[0, rows]]), torch.tensor([[-2, 3]], dtype=torch.int32)):
        outs = (values[:1, 0, :2].clone(), scales[:1, 0, :2].clone() if table.fp8 else None)
        with pytest.raises(ValueError, match=rf"layer 3 table: row ids must lie in \[0, {rows}\), got range "
                                             rf"\[{int(bad.min())}, {int(bad.max())}\]"):
            table.gather_stored(bad, out=outs)
    before = values.clone()
    with pytest.raises(ValueError, match="layer 3 table: row ids must be int32/int64, got torch.int16"):
        table.gather_stored(ids.to(torch.int16), out=(values, scales))
    if table.fp8:  # a wrong second buffer is refused before the first one is written
        with pytest.raises(ValueError, match=r"layer 3 table: out must be a contiguous torch.uint8 \[5, 7, 3, 2\]"):
            table.gather_stored(torch.zeros_like(ids), out=(values, scales[..., :1]))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        table.gather_stored(torch.zeros_like(ids), out=(values.transpose(0, 1), scales))
    assert torch.equal(values.view(torch.uint8), before.view(torch.uint8))
