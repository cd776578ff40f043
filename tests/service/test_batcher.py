"""Continuous batching: each request's tokens equal the same request decoded alone, with adapters of different
ranks and target sets and the bare base in one batch, and requests joining while others decode."""

import time

import numpy as np
import pytest
import torch

from dsv4flash.engine.sampling import Decoding, Sampling, generate
from dsv4flash.lora import LoraConfig
from dsv4flash.model.image import TEXT, prepare_vl_inputs
from dsv4flash.service.compute.batcher import ContinuousBatcher, Entry


def _adapter(resident, pc, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in resident.fresh_adapter(pc).items()}


def _requests(resident):
    """(entry, prompt ids or (ids, types, images), samples, sampling, seed) of 14 requests: three ranks of one
    target set, a decoder-only set (two of them on one prompt: a shared prefill), the base, and an image prompt;
    the last three join mid-decode."""
    full2, full4 = LoraConfig(preset="full_linear", rank=2), LoraConfig(preset="full_linear", rank=4, seed=1)
    full8 = LoraConfig(preset="full_linear", rank=8, alpha=3.0, seed=2)
    dec = LoraConfig(preset="decoder_half", rank=2)
    e = [Entry(full2, _adapter(resident, full2, 1)), Entry(full4, _adapter(resident, full4, 2)),
         Entry(full8, _adapter(resident, full8, 3)), Entry(dec, _adapter(resident, dec, 4)),
         Entry(dec, _adapter(resident, dec, 5)), Entry()]
    gen = torch.Generator().manual_seed(0)
    p = [torch.randint(3, 400, (n,), generator=gen) for n in (7, 7, 7, 9, 5, 11, 11)]
    image = np.random.default_rng(0).integers(0, 256, size=(42, 84, 3), dtype=np.uint8)
    cfg = resident.cfg
    pic = prepare_vl_inputs(torch.tensor([5, 6, 7, cfg.image_token_id, 8]), [image], cfg, dtype=torch.float32)
    same_length = torch.randint(3, 400, (pic[0].numel(),), generator=gen)  # a text prompt the image rows meet
    warm, greedy = Sampling(0.9, 20, 0.95, processed_greedy=True), Sampling(0.0, processed_greedy=True)
    return [(e[0], p[0], 2, warm, 11), (e[1], p[1], 1, greedy, 12), (e[5], p[2], 3, warm, 13),
            (e[2], p[0], 2, warm, 14), (e[3], p[3], 2, warm, 15), (e[4], p[3], 2, greedy, 16),
            (e[5], p[5], 2, warm, 20), (e[5], p[6], 1, greedy, 21),  # a cohort of the base alone
            # an image prompt (its own prefill) decoding with an adapter and the base beside a text prompt
            (e[0], pic, 2, warm, 22), (e[5], pic, 1, greedy, 23), (e[1], same_length, 2, warm, 24),
            # joining mid-decode: the same lengths as running requests, and new ones
            (e[1], p[4], 2, warm, 17), (e[5], p[0], 1, greedy, 18), (e[0], p[2], 3, warm, 19)]


def _state(prompt, n, sampling, seed, stop=()):
    row = prompt if isinstance(prompt, tuple) else (prompt, torch.full((prompt.numel(),), TEXT), [])
    return row, Decoding([row] * n, max_new_tokens=6, eos_id=None, pad_id=0, sampling=sampling,
                         generator=torch.Generator().manual_seed(seed), stop=stop, share_prefixes=False)


def _alone(resident, entry, prompt, n, sampling, seed, stop=()):
    row, _ = _state(prompt, n, sampling, seed)
    ctx = resident.bare() if entry.placement is None else resident.bind(entry.placement, entry.tensors)
    with ctx as model:
        return generate(model, [row] * n, max_new_tokens=6, eos_id=None, pad_id=0, sampling=sampling,
                        generator=torch.Generator().manual_seed(seed), stop=stop, share_prefixes=False)


@pytest.mark.parametrize("exact", [True, False])
def test_batched_requests_equal_each_alone(resident, exact):
    reqs = _requests(resident)
    stop = [(int(reqs[0][1][0]),)]  # a stop token some rows may hit: rows leave at different steps
    batcher = ContinuousBatcher(resident, exact=exact, gather_s=0.5)  # the first eleven arrive as one wave
    futures = []
    for i, (entry, prompt, n, sampling, seed) in enumerate(reqs):
        if i == len(reqs) - 3:  # the last three join while the others decode
            deadline = time.monotonic() + 120
            while batcher.stats.steps < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert batcher.live() > 0, "the first requests finished before the others joined"
        row, state = _state(prompt, n, sampling, seed, stop)
        futures.append(batcher.submit(entry, row, state))
    got = [f.result(timeout=300) for f in futures]
    batcher.close()
    assert batcher.stats.shared_prefills == 2  # the two decoder-only adapters on one prompt
    assert batcher.stats.batched_prefills == 5  # one length and target set: the three full-linear, the two base
    assert batcher.stats.rows > batcher.stats.steps  # steps really ran several requests' rows together
    assert batcher.stats.adapters > batcher.stats.steps  # and several adapters per pass
    for i, ((entry, prompt, n, sampling, seed), out) in enumerate(zip(reqs, got)):
        ref = _alone(resident, entry, prompt, n, sampling, seed, stop)
        assert torch.equal(out.mask, ref.mask), f"request {i}"
        assert torch.equal(out.tokens, ref.tokens), f"request {i}"
        if exact:
            assert torch.equal(out.logprobs, ref.logprobs), f"request {i}"
        else:
            torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=1e-4, msg=f"request {i}")


def test_jobs_and_entries_compare_by_identity():
    """A batcher's Job, Cohort and Entry hold tensors: `in`, `remove` and sets go by identity (a field-wise `==`
    would ask a tensor for its truth value)."""
    from concurrent.futures import Future

    from dsv4flash.service.compute.batcher import Cohort, Job

    pc = LoraConfig(preset="decoder_half", rank=2)
    twins = [Entry(pc, {"a": torch.ones(2, 3)}), Entry(pc, {"a": torch.ones(2, 3)})]  # equal fields, two requests
    jobs = [Job(e, (torch.arange(4),), None, Future()) for e in twins]
    assert jobs[1] in jobs and jobs[0] != jobs[1] and len({*jobs, *twins}) == 4
    jobs.remove(jobs[1])
    assert len(jobs) == 1 and jobs[0].entry is twins[0]
    cohorts = [Cohort(None, jobs, None), Cohort(None, list(jobs), None)]
    assert cohorts.index(cohorts[1]) == 1
