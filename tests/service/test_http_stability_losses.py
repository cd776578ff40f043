"""Tinker 0.38's `gspo` and `stable_reinforce` losses, provenance spans and `topk_sample_logprobs`: the loss
gradients against hand-written formulas, then the real `tinker` SDK (and tinker-cookbook's provenance helper)
through `dsv4flash serve`, each equal to the same calls on the in-process service core."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tinker  # the real SDK: a test dependency (ci/install.sh test)
from tinker import types

import dsv4flash.service as core  # noqa: E402
from dsv4flash.service.compute import losses  # noqa: E402
from dsv4flash.service.compute.stability import Provenance  # noqa: E402

LP = torch.tensor([-1.2, -0.3, -2.0, -0.7, -1.1], dtype=torch.float64)
Q = torch.tensor([0.0, -0.5, -1.9, -0.9, -1.0], dtype=torch.float64)
ADV = torch.tensor([0.0, 1.5, 1.5, -0.5, -0.5], dtype=torch.float64)
MASK = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)


def _grad(loss_fn, config=None, provenance=None, mask=MASK):
    logp = LP.clone().requires_grad_(True)
    inputs = {"logprobs": Q, "advantages": ADV, **({"sequence_ratio_mask": mask} if mask is not None else {})}
    losses.datum_loss(loss_fn, logp, inputs, config, provenance).backward()
    return logp.grad


@pytest.mark.parametrize("low,high", [(0.0, 10.0), (1 - 3e-4, 1 + 4e-4), (0.95, 1.02)])
def test_gspo_gradient_is_the_sequence_ratio_formula(low, high):
    s = float(np.exp(np.mean((LP - Q).numpy()[1:])))  # geometric-mean ratio over the masked tokens
    clipped = min(max(s, low), high)
    want = [-a * s if (s * a <= clipped * a or low <= s <= high) else 0.0 for a in ADV.tolist()]
    got = _grad("gspo", {"clip_low_threshold": low, "clip_high_threshold": high})
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)
    # without a mask the ratio runs over the trained (nonzero-advantage) tokens, never the padded prompt row
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 9.0}
    s_wide = float(np.exp(np.mean((LP - Q).numpy()[1:])))
    np.testing.assert_allclose(_grad("gspo", wide, mask=None), -ADV.numpy() * s_wide, rtol=1e-12)
    with pytest.raises(ValueError, match="sequence_ratio_mask marks no token"):
        _grad("gspo", wide, mask=torch.zeros(5, dtype=torch.float64))


@pytest.mark.parametrize("cap,kl", [(2.0, 0.0), (1.05, 0.3)])
def test_stable_reinforce_gradient_is_truncated_is_on_sampled_tokens(cap, kl):
    sampled = torch.tensor([False, True, True, True, True])
    mu = torch.tensor([0.0, -0.2, -2.5, -0.9, -0.8])  # the recorded sampler log-probs (not the client's Q)
    prov = Provenance(sampled, mu)
    w = np.minimum(np.exp(LP.numpy() - mu.double().numpy()), cap)
    want = np.where(sampled.numpy(), -w * ADV.numpy() + kl * (LP.numpy() - mu.double().numpy()), 0.0)
    got = _grad("stable_reinforce", {"clip_high_threshold": cap, "kl_coeff": kl}, prov)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    with pytest.raises(ValueError, match="advantages position 1 is nonzero"):
        _grad("stable_reinforce", None, Provenance(torch.tensor([True, False, True, True, True]), mu))
    with pytest.raises(ValueError, match="needs provenance"):
        _grad("stable_reinforce", None, None)


def test_loss_fn_config_options_are_refused_by_name():
    with pytest.raises(ValueError, match=r"loss_fn_config\['beta'\]: not an option of loss_fn 'gspo'"):
        losses.check_config("gspo", {"beta": 0.1})
    with pytest.raises(ValueError, match=r"loss_fn_config\['clip_low_threshold'\]: not an option.*stable_reinforce"):
        losses.check_config("stable_reinforce", {"clip_low_threshold": 0.5})
    losses.check_config("stable_reinforce", {"kl_coeff": 0.1, "clip_high_threshold": 3.0})


PROMPT = [0, 10, 11, 12]


def _rl_data(mod, prompt, seqs, loss_fn, provenance):
    """tinker-cookbook rl_loop's datums (gspo: sequence_ratio_mask; stable_reinforce: its provenance helper)."""
    rewards = np.array([np.mean([t % 2 == 0 for t in s.tokens]) for s in seqs])
    data = []
    for s, a in zip(seqs, rewards - rewards.mean()):
        ob = len(prompt) - 1
        inputs = {"target_tokens": np.array([0] * ob + list(s.tokens), dtype=np.int64),
                  "logprobs": np.array([0.0] * ob + list(s.logprobs), dtype=np.float32),
                  "advantages": np.array([0.0] * ob + [a] * len(s.tokens), dtype=np.float32)}
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = np.array([0.0] * ob + [1.0] * len(s.tokens), dtype=np.float32)
        d = mod.Datum(model_input=mod.ModelInput.from_ints(prompt + list(s.tokens[:-1])), loss_fn_inputs=inputs)
        data.append(provenance(d, len(prompt), len(s.tokens), s.sequence_id) if provenance else d)
    return data


def _core_provenance(datum, prompt_length, num_sampled, sequence_id):
    return datum.with_provenance(
        model_input=[core.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_length),
                     core.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled - 1)],
        loss_fn_inputs=[core.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=prompt_length - 1),
                        core.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled)])


@pytest.mark.parametrize("loss_fn", ["gspo", "stable_reinforce"])
def test_sdk_rl_steps_match_in_process_core(sdk, resident, tmp_path, loss_fn):
    from tinker_cookbook.recipes.rl_loop import with_sampled_provenance  # the cookbook's own span builder

    record = loss_fn == "stable_reinforce"
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    local = core.ServiceClient(root=tmp_path, resident=resident).create_lora_training_client(base_model="tiny", rank=4)
    params = types.SamplingParams(max_tokens=4, seed=5, temperature=1.0)
    config = {"kl_coeff": 0.1} if record else {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    for _ in range(2):
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record).result()
        seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
        local_seqs = local.save_weights_and_get_sampling_client(record_stability_info=record).sample(
            core.types.ModelInput.from_ints(PROMPT), 4, core.types.SamplingParams(max_tokens=4, seed=5)).result()
        assert [list(s.tokens) for s in seqs] == [s.tokens for s in local_seqs.sequences]
        data = _rl_data(types, PROMPT, seqs, loss_fn, with_sampled_provenance if record else None)
        local_data = _rl_data(core.types, PROMPT, local_seqs.sequences, loss_fn, _core_provenance if record else None)
        out = tc.forward_backward(data, loss_fn, loss_fn_config=config).result()
        ref = local.forward_backward(local_data, loss_fn, config).result()
        assert np.isfinite(out.metrics["loss:sum"]) and out.metrics["loss:sum"] == ref.metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        local.optim_step(core.types.AdamParams(learning_rate=2e-2)).result()
    after = tc.forward(data[:1], loss_fn, loss_fn_config=config).result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.array_equal(after[len(PROMPT) - 1:], data[0].loss_fn_inputs["logprobs"].to_numpy()[len(PROMPT) - 1:])
    with pytest.raises(tinker.BadRequestError, match="not an option of loss_fn"):
        tc.forward_backward(data, loss_fn, loss_fn_config={"nonsense": 1.0}).result()


def test_provenance_spans_are_validated_per_tenant(server, sdk):
    from tests.service.http_server import service_client
    from tinker_cookbook.recipes.rl_loop import with_sampled_provenance

    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    params = types.SamplingParams(max_tokens=3, seed=2, temperature=1.0)
    seqs = tc.save_weights_and_get_sampling_client(record_stability_info=True).result().sample(
        types.ModelInput.from_ints(PROMPT), 2, params).result().sequences
    good = _rl_data(types, PROMPT, seqs, "stable_reinforce", with_sampled_provenance)
    loss = tc.forward(good, "stable_reinforce").result().metrics["loss:sum"]
    assert np.isfinite(loss) and loss != 0.0
    # the sampler log-probs come from the records: a tampered client copy changes nothing
    tampered = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "logprobs": types.TensorData.from_numpy(d.loss_fn_inputs["logprobs"].to_numpy() - 3.0)})
        .with_provenance(model_input=d.model_input_spans, loss_fn_inputs=d.loss_fn_input_spans) for d in good]
    assert tc.forward(tampered, "stable_reinforce").result().metrics["loss:sum"] == loss
    # (importance_sampling does read it: its loss of the first datum scales by e³)
    is_loss = [tc.forward(d[:1], "importance_sampling").result().metrics["loss:sum"] for d in (good, tampered)]
    assert is_loss[0] != 0.0 and is_loss[1] == pytest.approx(is_loss[0] * np.exp(3.0), rel=1e-5)

    def swap_id(datum, sequence_id):
        return datum.with_provenance(model_input=[type(s)(sequence_id=sequence_id, offset=s.offset, length=s.length)
                                                  for s in datum.model_input_spans],
                                     loss_fn_inputs=[type(s)(sequence_id=sequence_id, offset=s.offset,
                                                             length=s.length) for s in datum.loss_fn_input_spans])

    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.model_input_spans\[0\]\.sequence_id: 'nope:0' is "
                                                     r"not a sequence this tenant sampled"):
        tc.forward([swap_id(good[0], "nope:0")], "stable_reinforce").result()
    # bob's recorded sequence reads to alice exactly as an unknown one
    with service_client(server, "bob") as bob:
        btc = bob.create_lora_training_client(base_model="tiny", rank=4).result()
        theirs = btc.save_weights_and_get_sampling_client(record_stability_info=True).result().sample(
            types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
    with pytest.raises(tinker.BadRequestError, match=rf"sequence_id: '{theirs.sequence_id}' is not a sequence this "
                                                     r"tenant sampled"):
        tc.forward([swap_id(good[0], theirs.sequence_id)], "stable_reinforce").result()
    # a sampled run must reproduce the recorded tokens
    bad = types.Datum(model_input=good[0].model_input,
                      loss_fn_inputs={**good[0].loss_fn_inputs, "target_tokens": types.TensorData.from_numpy(
                          np.array([0] * 3 + [(seqs[0].tokens[0] + 1) % 64] + list(seqs[0].tokens[1:]), np.int64))})
    bad = bad.with_provenance(model_input=good[0].model_input_spans, loss_fn_inputs=good[0].loss_fn_input_spans)
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_input_spans\[1\]: position 3 is token"):
        tc.forward([bad], "stable_reinforce").result()
    # sampled without record_stability_info: fine as provenance of another loss, refused for stable_reinforce
    plain = tc.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(PROMPT), 1, params).result().sequences
    plain_data = _rl_data(types, PROMPT, plain, "stable_reinforce", with_sampled_provenance)[:1]
    assert np.isfinite(tc.forward(plain_data, "importance_sampling").result().metrics["loss:sum"])
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_input_spans\[1\]\.sequence_id: .* was sampled "
                                                     r"without record_stability_info"):
        tc.forward(plain_data, "stable_reinforce").result()
    # an unknown sequence is refused whatever the loss
    with pytest.raises(tinker.BadRequestError, match="is not a sequence this tenant sampled"):
        tc.forward([swap_id(plain_data[0], "nope:1")], "importance_sampling").result()


def test_topk_sample_logprobs_are_the_sampling_distributions_top_k(sdk, resident):
    from dsv4flash.engine.sampling import process_logits

    sampler = sdk.create_sampling_client(base_model="tiny").result()
    params = types.SamplingParams(max_tokens=5, seed=3, temperature=0.7, top_k=6)
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params, topk_sample_logprobs=4).result().sequences[0]
    assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
    with torch.no_grad():
        logits = resident.model(torch.tensor([PROMPT + list(seq.tokens[:-1])]))[0, len(PROMPT) - 1:]  # [T,V]
    ref = process_logits(logits, core.types.SamplingParams(max_tokens=5, temperature=0.7, top_k=6)).topk(4, -1)
    for row, ids, vals, tok, lp in zip(seq.topk_logprobs, ref.indices, ref.values, seq.tokens, seq.logprobs):
        assert [t for t, _ in row] == ids.tolist()
        np.testing.assert_allclose([v for _, v in row], vals.numpy(), atol=2e-5)
        assert dict(row).get(tok, lp) == pytest.approx(lp, abs=1e-6)  # the sampled token's own log-prob agrees
    # topk_prompt_logprobs: each prompt position's top-k of the model's own next-token distribution
    resp = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params, include_prompt_logprobs=True,
                          topk_prompt_logprobs=3).result()
    with torch.no_grad():
        ref = torch.log_softmax(resident.model(torch.tensor([PROMPT]))[0, :-1].float(), -1).topk(3, -1)  # [P-1,3]
    assert resp.topk_prompt_logprobs[0] is None and len(resp.topk_prompt_logprobs) == len(PROMPT)
    for row, ids, vals in zip(resp.topk_prompt_logprobs[1:], ref.indices, ref.values):
        assert [t for t, _ in row] == ids.tolist()
        np.testing.assert_allclose([v for _, v in row], vals.numpy(), atol=2e-5)
    assert resp.prompt_logprobs[0] is None and len(resp.prompt_logprobs) == len(PROMPT)


class _WordTokenizer:
    """Encodes words by a fixed table (the tiny base emits ids outside the task vocabulary's words)."""

    def __init__(self, table: dict[str, int]) -> None:
        self.table = table

    def encode(self, text: str) -> list[int]:
        return [self.table[w] for w in text.split()]


def test_multi_token_stop_strings_stop_on_the_whole_sequence(resident, tmp_path):
    service = core.ServiceClient(root=tmp_path, resident=resident)
    sampler = service.create_sampling_client()
    prompt = core.types.ModelInput.from_ints(PROMPT)
    free = sampler.sample(prompt, 1, core.types.SamplingParams(max_tokens=8, temperature=0.0)).result()
    toks = free.sequences[0].tokens
    assert len(toks) >= 4
    a, b, c = toks[1], toks[2], toks[3]
    service._tokenizer = _WordTokenizer({"a": a, "b": b, "c": c, "z": 511 if 511 not in toks else 510})
    stop_ab = core.types.SamplingParams(max_tokens=8, temperature=0.0, stop=["z", "a b"])
    got = sampler.sample(prompt, 1, stop_ab).result()
    # stops at the first place the sampled tokens end with [a, b] (not at a lone a)
    end = next(i for i in range(1, len(toks)) if toks[i - 1:i + 1] == [a, b]) + 1
    assert got.sequences[0].tokens == toks[:end] and got.sequences[0].stop_reason == "stop"


def test_sequence_records_expire_and_stay_bounded():
    from dsv4flash.service.compute.stability import SequenceRecords

    records = SequenceRecords(ttl_s=3600.0, max_per_owner=2)
    for i in range(3):
        records.record("alice", f"s{i}", (0, 1), [5], [-0.5], stability=True)
    with pytest.raises(KeyError, match="x.sequence_id: 's0' is not a sequence this tenant sampled"):
        records.get("alice", "s0", "x.sequence_id")  # the least recently used went first
    assert records.get("alice", "s1", "where").tokens == [5]
    with pytest.raises(KeyError, match="'s1' is not a sequence"):
        records.get("bob", "s1", "where")  # another owner's id is unknown
    expired = SequenceRecords(ttl_s=0.0)
    expired.record("alice", "s", (0,), [5], [-0.5], stability=True)
    with pytest.raises(KeyError, match="unknown or expired"):
        expired.get("alice", "s", "where")


def test_core_with_provenance_checks_the_tiling():
    d = core.Datum(model_input=core.ModelInput.from_ints([0, 1, 2]),
                   loss_fn_inputs={"target_tokens": np.array([1, 2, 3], dtype=np.int64)})
    span = core.SampledProvenanceSpan(sequence_id="s:0", length=2)
    with pytest.raises(ValueError, match="with_provenance model_input spans cover 2 positions but the field has 3"):
        d.with_provenance(model_input=[span], loss_fn_inputs=[span])
    with pytest.raises(AssertionError, match="provenance comes as a pair"):  # tinker's Datum asserts the pair
        core.Datum(d.model_input, d.loss_fn_inputs, model_input_spans=[span])
