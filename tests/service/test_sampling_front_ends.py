"""The one decode loop (`dsv4flash.engine.sampling.generate`) behind every front end: the local engine, the Tinker
service's `SamplingClient` and the veRL rollout backend draw the same tokens and log-probs from the same model
and seed, bit for bit, and the draws are the ones recorded before the three shared the loop."""

from __future__ import annotations

import pytest
import torch

from dsv4flash.engine.sampling import Sampling, generate
from dsv4flash.model.image import TEXT
from dsv4flash.service import types

PROMPT = [0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
# Drawn from the tiny base (Transformer seed 0) before the service and the rollout backend shared the loop
# (SamplingParams(max_tokens=8, temperature=0.7, top_k=5, top_p=0.8, seed=9), one sample).
RECORDED_TOKENS = [249, 253, 171, 157, 115, 412, 0, 29]
RECORDED_LOGPROBS = [-1.4447619915008545, -1.395985722541809, -1.4148797988891602]


@pytest.fixture(scope="module")
def front_ends(tmp_path_factory):
    """(the base as a plain model, a service sampling client, a veRL rollout engine), all on one saved base."""
    import dsv4flash.service as tinker
    from dsv4flash.config import load_config
    from dsv4flash.engine import model_io
    from dsv4flash.integrations.verl.rollout.engine import RolloutEngine
    from dsv4flash.model.transformer import Transformer
    from dsv4flash.tasks.tokenizer import TaskTokenizer

    cfg = load_config("tiny")
    model = Transformer(cfg, seed=0).eval()
    base_dir = model_io.save_base(model, cfg, TaskTokenizer(cfg), tmp_path_factory.mktemp("front_ends") / "base",
                                  {"kind": "test"})
    service = tinker.ServiceClient(root=tmp_path_factory.mktemp("service"), base_dir=base_dir)
    return model, service.create_sampling_client(), RolloutEngine(base_dir)


def _local(model, n: int, sampling: Sampling, seed: int | None, max_tokens: int, **kw):
    row = (torch.tensor(PROMPT), torch.full((len(PROMPT),), TEXT), [])
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return generate(model, [row] * n, max_new_tokens=max_tokens, eos_id=model.cfg.eos_token_id,
                    pad_id=model.cfg.pad_token_id, sampling=sampling, generator=gen, **kw)


@pytest.mark.parametrize("temperature,top_k,top_p,seed", [(1.0, -1, 1.0, 5), (0.7, 5, 0.8, 9)])
def test_engine_service_and_rollout_draw_the_same_tokens(front_ends, temperature, top_k, top_p, seed):
    model, sampler, rollout = front_ends
    params = types.SamplingParams(max_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    served = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
    rolled = rollout.generate(PROMPT, {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed},
                              max_tokens=8)
    local = _local(model, 1, Sampling(temperature, top_k, top_p), seed, 8)
    assert served.tokens == rolled.token_ids == local.response(0)
    assert served.logprobs == rolled.log_probs == local.response_logprobs(0)  # bit for bit
    if seed == 9:
        assert served.tokens == RECORDED_TOKENS
        assert served.logprobs[:3] == pytest.approx(RECORDED_LOGPROBS, abs=1e-6)


def test_greedy_log_probs_are_the_models_except_in_the_service(front_ends):
    # vLLM's greedy (the engine, the rollout) reports the model's log-softmax; the service reports the processed
    # distribution's (temperature ~0: the chosen token has probability 1).
    model, sampler, rollout = front_ends
    served = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=5, temperature=0.0))
    served = served.result().sequences[0]
    rolled = rollout.generate(PROMPT, {"temperature": 0.0}, max_tokens=5)
    local = _local(model, 1, Sampling(0.0), None, 5)
    assert served.tokens == rolled.token_ids == local.response(0)
    assert served.logprobs == [0.0] * 5
    assert rolled.log_probs == local.response_logprobs(0)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + served.tokens]))[0, len(PROMPT) - 1: -1], -1)
    assert rolled.log_probs == pytest.approx(logp.gather(-1, torch.tensor(served.tokens)[:, None]).flatten().tolist(),
                                             abs=1e-5)


def test_service_samples_decode_as_rows_of_their_own(front_ends):
    # The service's n samples are n batch rows (no prefix sharing), its top-k rows come from the same
    # distribution; the engine's prefix-sharing layout draws the same tokens up to fp32 rounding.
    model, sampler, _ = front_ends
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    served = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params, topk_sample_logprobs=3).result()
    own = _local(model, 4, Sampling(1.0), 5, 6, share_prefixes=False, topk=3)
    shared = _local(model, 4, Sampling(1.0), 5, 6)
    for r, seq in enumerate(served.sequences):
        assert seq.tokens == own.response(r) == shared.response(r)
        assert seq.logprobs == own.response_logprobs(r)
        assert seq.logprobs == pytest.approx(shared.response_logprobs(r), abs=1e-5)
        assert seq.topk_logprobs == own.top[r] and len(own.top[r][0]) == 3
        assert seq.stop_reason == ("stop" if bool(own.stopped[r]) else "length")
