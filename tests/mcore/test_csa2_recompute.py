"""Full activation recompute keeps the CSA2 state in the autograd graph (megatron-core 0.19, CPU).

The CSA2 state (compressed KV, index keys, top-k, candidates) and the mHC `pre_mix` cross every checkpoint
boundary as explicit inputs/outputs of `tensor_parallel.checkpoint`, so recompute gradients equal the
no-recompute gradients bit for bit. A naive variant that parks the state on a module attribute (values
right, graph gone: produced under the checkpoint's `no_grad`) gives the same forward and silently loses
every later consumer's gradient to the producer compressor — the failure this design exists to avoid.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel

from dsv4flash.integrations.mcore.csa2.block import CSA2TransformerBlock
from dsv4flash.integrations.mcore.csa2.carry import CSA2Context
from tests.mcore import csa2_support as sup
from tests.mcore_cpu import parallel

pytestmark = pytest.mark.upstream

PRODUCERS = (  # compressor weights of the kv sources: layer 2 (ratio 2) and layer 6 (ratio 1, the CED source)
    "decoder.layers.2.self_attention.compressor.linear_kv.weight",
    "decoder.layers.2.self_attention.compressor.linear_gate.weight",
    "decoder.layers.6.self_attention.compressor.linear_kv.weight",
)


class SideChannelBlock(CSA2TransformerBlock):
    """The naive design: only the streams cross the checkpoint; the CSA2 state is stashed on the module."""

    def _checkpointed_chunk(self, start, end, streams, ctx, run):
        tokens = ctx.tokens
        self._stash = getattr(self, "_stash", {})
        self._stash[start] = ctx.state  # a side channel: right values, but produced under no_grad

        def chunk(streams, pre_mix):
            c = CSA2Context(pre_mix, self._stash[start], tokens)
            streams, c = self._run_layers(start, end, streams, c, run)
            self._stash[end] = c.state
            return streams, c.pre_mix

        streams, pre_mix = tensor_parallel.checkpoint(chunk, False, streams, ctx.pre_mix)
        return streams, CSA2Context(pre_mix, self._stash[end], tokens)


@pytest.fixture(scope="module")
def setup():
    """Reference weights, a batch, and the no-recompute Megatron gradients (the baseline)."""
    with parallel.model_parallel(seed=1234), sup.single_thread():
        ref = sup.reference(seed=0)
        ids = sup.token_ids(1, 48, seed=11)
        weights = sup.probe((1, 48, sup.VOCAB), seed=12)
        base = sup.megatron_from(ref)
        logits = base(ids)
        (logits * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in base.named_parameters() if p.grad is not None}
        yield ref, ids, weights, logits.detach(), grads


def _run(ref, ids, weights, **kwargs):
    model = sup.megatron_from(ref, **kwargs)
    logits = model(ids)
    (logits * weights).sum().backward()
    return model, logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset, overrides", [
    ("full", {}),  # uniform, one layer per chunk: every consumer sits in a later chunk than its producer
    ("full", {"recompute_num_layers": 5}),  # uniform chunks that cut through the producer/consumer chains
    ("full_block", {"recompute_num_layers": 7}),  # block: the first 7 layers checkpointed, the rest not
    ("full_block", {}),  # the preset: every layer but the last
])
def test_full_recompute_gradients_equal_no_recompute_exactly(setup, preset, overrides):
    ref, ids, weights, logits, grads = setup
    _, got_logits, got = _run(ref, ids, weights, recompute=preset, overrides=overrides)
    assert torch.equal(got_logits, logits)
    assert set(got) == set(grads)
    for name, grad in grads.items():
        assert torch.equal(got[name], grad), f"{name}: recompute gradient differs"
    for name in PRODUCERS:
        assert bool(got[name].abs().sum() > 0), f"{name}: the producer compressor got no gradient"


def test_state_crosses_each_checkpoint_as_explicit_tensors(setup, monkeypatch):
    ref, ids, weights, _, _ = setup
    seen = []
    real = tensor_parallel.checkpoint

    def spy(function, distribute, *args):
        seen.append(args)
        return real(function, distribute, *args)

    monkeypatch.setattr(tensor_parallel, "checkpoint", spy)
    _run(ref, ids, weights, recompute="full")
    assert len(seen) == ref.cfg.text.num_hidden_layers
    # (streams, pre_mix, compress_kv, index_k, topk, candidates); chunk 3 receives layer 2's compressed KV
    assert all(len(args) == 6 for args in seen)
    streams, pre_mix, compress_kv, index_k, topk, candidates = seen[3]
    assert compress_kv.requires_grad and compress_kv.grad_fn is not None  # in the graph, not a detached copy
    assert topk.dtype == torch.long and candidates is None
    assert seen[7][5] is not None and seen[7][5].dtype == torch.bool  # layer 6's candidates reach layer 7


def test_side_channel_state_loses_the_producer_gradient(setup, monkeypatch):
    ref, ids, weights, logits, grads = setup
    monkeypatch.setattr(CSA2TransformerBlock, "_checkpointed_chunk", SideChannelBlock._checkpointed_chunk)
    _, naive_logits, naive = _run(ref, ids, weights, recompute="full")
    assert torch.equal(naive_logits, logits)  # the forward cannot tell: the failure is silent
    for name in PRODUCERS:
        err = float((naive[name] - grads[name]).abs().max())
        assert err > 1e-3 * float(grads[name].abs().max()), f"{name}: the side channel kept the gradient?"
    # Layer 6's compressor feeds only later layers' compressed keys besides its own: most of its gradient is gone.
    name = "decoder.layers.6.self_attention.compressor.linear_kv.weight"
    assert float(naive[name].norm()) < 0.9 * float(grads[name].norm())


def test_frozen_embedding_still_trains_inner_parameters_under_recompute(setup):
    ref, ids, weights, _, grads = setup
    model = sup.megatron_from(ref, recompute="full")
    trainable = {"decoder.layers.3.self_attention.linear_q_up.weight", PRODUCERS[2]}
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)
    (model(ids) * weights).sum().backward()
    for name, param in model.named_parameters():
        if name in trainable:
            assert torch.equal(param.grad, grads[name]), name
        else:
            assert param.grad is None, name


def test_recompute_replays_the_forward_selections(setup, monkeypatch):
    from dsv4flash.integrations.mcore.csa2.indexer import CSA2Indexer

    ref, ids, weights, _, grads = setup
    calls = []
    real = CSA2Indexer.select
    monkeypatch.setattr(CSA2Indexer, "select", lambda self, scores, table: calls.append(1) or real(self, scores, table))
    _, _, got = _run(ref, ids, weights, recompute="full")
    # Each index source picks once, in the first pass; the backward recompute replays its choice.
    assert len(calls) == len(ref.cfg.text.index_source_layer_ids)
    name = "decoder.layers.8.self_attention.linear_q_up.weight"  # a Reindex layer's attention still trains
    assert torch.equal(got[name], grads[name])
