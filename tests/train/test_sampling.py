"""Sampling with the reference model: sampled log-probs equal the teacher-forced ones; shared prefixes are
computed once without changing the result."""

import itertools

import pytest
import torch

from dsv4flash.config import load_config
from dsv4flash.engine.losses import token_logprobs
from dsv4flash.engine.sampling import generate
from dsv4flash.model.quant import fake_quant
from dsv4flash.model.transformer import Transformer
from dsv4flash.tasks import Encoder, TaskMixture, TaskTokenizer, build_task

CFG = load_config("tiny")


class Counting:
    """Wraps a model and records how many rows each forward ran."""

    def __init__(self, model):
        self.model, self.rows = model, []

    def __call__(self, ids, types, images):
        self.rows.append(ids.shape[0])
        return self.model(ids, types, images)


def _setup(n_prompts=3):
    model = Transformer(CFG, seed=0).eval()
    enc = Encoder(TaskTokenizer(CFG), CFG)
    mix = TaskMixture({"geometry": build_task("geometry"), "arithmetic": build_task("arithmetic")},
                      {"geometry": 1.0, "arithmetic": 1.0}, seed=0, val_size=0)
    prompts = [enc.prompt(ex) for _, ex in mix.train_batch(0, n_prompts)]
    return model, enc, prompts


def _length_independent_topk(x, k, dim=-1, **kwargs):
    """torch.topk with ties broken toward the lower index whatever the length of `dim`."""
    order = torch.arange(x.shape[dim], dtype=torch.float64).view([-1] + [1] * (x.ndim - 1 - (dim % x.ndim)))
    idx = _TOPK(x.double() - order * 1e-9, k, dim=dim, **kwargs).indices
    return torch.return_types.topk((x.gather(dim, idx), idx))


_TOPK = torch.topk


def test_sampled_logprobs_match_teacher_forcing(monkeypatch):
    # The reference indexer's torch.topk breaks score ties (ReLU zeros) differently for different lengths of
    # the compressed axis, so trailing tokens can move a prefix logit by ~1e-2 (a genuine train/rollout
    # mismatch source). A length-independent tie break isolates the bookkeeping checked here; equal-length
    # prompts and no eos keep every row unpadded.
    monkeypatch.setattr(torch, "topk", _length_independent_topk)
    model = Transformer(CFG, seed=0).eval()
    enc = Encoder(TaskTokenizer(CFG), CFG)
    mix = TaskMixture({"geometry": build_task("geometry", questions=("count_all",))}, {"geometry": 1.0}, seed=0,
                      val_size=0)
    prompts = [enc.prompt(ex) for _, ex in mix.train_batch(0, 3)]
    assert len({p[0].numel() for p in prompts}) == 1

    def no_eos(ids, types, images):
        logits = model(ids, types, images)
        logits[..., enc.tok.eos_id] = -1e4
        return logits

    rows = [p for p in prompts for _ in range(4)]
    out = generate(no_eos, rows, max_new_tokens=3, eos_id=enc.tok.eos_id, pad_id=enc.tok.pad_id, temperature=0.7,
                   generator=torch.Generator().manual_seed(0))
    assert bool(out.mask.all())
    batch = enc.collate([(p[0], p[1], p[2], torch.tensor(out.response(i))) for i, p in enumerate(rows)])
    with torch.no_grad():
        lp = token_logprobs(no_eos(batch.input_ids, batch.token_types, batch.images), batch.input_ids, 0.7)
    assert torch.allclose(lp[batch.target_mask].view(12, 3), out.logprobs, atol=1e-5)
    assert len({tuple(out.response(i)) for i in range(12)}) > 3  # temperature sampling actually varies


def test_greedy_groups_share_prefix_compute_and_match_single_rows(monkeypatch):
    monkeypatch.setattr(torch, "topk", _length_independent_topk)  # rows of other lengths pad this one
    model, enc, prompts = _setup()
    counter = Counting(model)
    grouped = generate(counter, [p for p in prompts for _ in range(5)], max_new_tokens=3, eos_id=enc.tok.eos_id,
                       pad_id=enc.tok.pad_id, temperature=0.0)
    assert counter.rows[0] == len(prompts)  # the first token of each 5-row group is computed once
    assert max(counter.rows) <= len(prompts)  # greedy rows never diverge within a group
    for i, p in enumerate(prompts):
        single = generate(model, [p], max_new_tokens=3, eos_id=enc.tok.eos_id, pad_id=enc.tok.pad_id,
                          temperature=0.0)
        for j in range(5):
            assert grouped.response(5 * i + j) == single.response(0)
            assert torch.allclose(grouped.logprobs[5 * i + j][grouped.mask[5 * i + j]],
                                  single.logprobs[0][single.mask[0]], atol=1e-5)


def test_rows_stop_at_eos():
    model, enc, prompts = _setup()

    def eos_after_one(ids, types, images):
        logits = model(ids, types, images)
        logits[..., enc.tok.eos_id] = torch.where(types[0, -1] < 0, 1e4, -1e4)  # eos is always the argmax
        return logits

    out = generate(eos_after_one, prompts, max_new_tokens=4, eos_id=enc.tok.eos_id, pad_id=enc.tok.pad_id,
                   temperature=0.0)
    assert all(out.response(i) == [enc.tok.eos_id] for i in range(len(prompts)))
    assert out.mask.sum().item() == len(prompts)


def _recompute(model):
    """The model as a plain (ids, types, images) -> logits callable: generate recomputes every step."""
    return lambda ids, types, images: model(ids, types, images)


def test_cached_decode_samples_what_full_recompute_samples(one_thread):
    model, enc, prompts = _setup(6)
    assert any(p[2] for p in prompts) and len({p[0].numel() for p in prompts}) > 1  # images, ragged prompts
    rows = [p for p in prompts for _ in range(4)]
    # log-probs are compared with the fake-quant points off: at a code boundary an ulp of another summation order
    # moves a quantized lane by a whole code (docs/testing.md); the tokens are compared with them on as well
    for quantized, temperature in itertools.product((True, False), (0.9, 0.0)):
        with fake_quant(quantized):
            runs = [generate(fwd, rows, max_new_tokens=6, eos_id=enc.tok.eos_id, pad_id=enc.tok.pad_id,
                             temperature=temperature, generator=torch.Generator().manual_seed(7))
                    for fwd in (model, _recompute(model))]
        cached, full = runs
        assert torch.equal(cached.tokens, full.tokens) and torch.equal(cached.mask, full.mask)
        if not quantized:
            assert torch.allclose(cached.logprobs, full.logprobs, atol=1e-5)
        assert len({tuple(cached.response(i)) for i in range(len(rows))}) > 1


def test_use_cache_false_forces_recompute_and_true_needs_a_model():
    model, enc, prompts = _setup()
    counter = Counting(model)
    generate(counter, prompts[:1], max_new_tokens=2, eos_id=enc.tok.eos_id, pad_id=enc.tok.pad_id, temperature=0.0,
             use_cache=False)
    assert len(counter.rows) == 2
    with pytest.raises(ValueError, match="no prefill/decode"):
        generate(counter, prompts[:1], max_new_tokens=2, eos_id=enc.tok.eos_id, pad_id=enc.tok.pad_id, use_cache=True)
