"""The real `tinker` SDK (0.38) drives `dsv4flash serve`: a supervised loop and an RL loop (importance_sampling,
ppo, cispo), each bit-identical to the same calls on the in-process service core."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

import dsv4flash.service as core
from tests.service.http_server import rl_batch


def _sl_datum(mod, tokens, prompt_len):
    # cookbook: weights 0 on the prompt, 1 on the completion; inputs/targets shifted by one
    weights = np.array([0] * prompt_len + [1] * (len(tokens) - prompt_len), dtype=np.float32)[1:]
    return mod.Datum(model_input=mod.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs=dict(weights=weights, target_tokens=np.array(tokens[1:], dtype=np.int64)))


EXAMPLES = [([0, 10, 11, 12, 20, 21, 22, 1], 4), ([0, 13, 14, 15, 23, 24, 25, 1], 4)]


def test_supervised_loop_matches_in_process_core(sdk, resident, tmp_path):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    assert isinstance(tc, tinker.TrainingClient)
    local = core.ServiceClient(root=tmp_path, resident=resident).create_lora_training_client(base_model="tiny", rank=4)
    http_data = [_sl_datum(types, t, p) for t, p in EXAMPLES]
    local_data = [_sl_datum(core.types, t, p) for t, p in EXAMPLES]
    losses = []
    for _ in range(4):
        fwdbwd = tc.forward_backward(http_data, "cross_entropy")  # pipelined: both queued before waiting
        optim = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        out, _ = fwdbwd.result(), optim.result()
        ref = local.forward_backward(local_data, "cross_entropy").result()
        local.optim_step(core.types.AdamParams(learning_rate=5e-3)).result()
        for got, want in zip(out.loss_fn_outputs, ref.loss_fn_outputs):
            np.testing.assert_array_equal(got["logprobs"].to_numpy(), want["logprobs"].to_numpy())
        assert out.metrics["loss:sum"] == ref.metrics["loss:sum"]
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 0.1, losses
    # forward (no gradients) through the SDK: same log-probs as the core's forward
    fwd = tc.forward(http_data, "cross_entropy").result()
    ref = local.forward(local_data, "cross_entropy").result()
    np.testing.assert_array_equal(fwd.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                  ref.loss_fn_outputs[0]["logprobs"].to_numpy())
    path = tc.save_weights_for_sampler(name="final").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/final")
    sampler = sdk.create_sampling_client(model_path=path).result()
    resp = sampler.sample(types.ModelInput.from_ints([0, 10, 11, 12]), 2,
                          types.SamplingParams(max_tokens=3, seed=7, temperature=1.0)).result()
    assert len(resp.sequences) == 2 and all(len(s.tokens) <= 3 for s in resp.sequences)
    assert all(len(s.logprobs) == len(s.tokens) for s in resp.sequences)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_rl_loop_matches_in_process_core(sdk, resident, tmp_path, loss_fn):
    tc = sdk.create_lora_training_client(base_model="tiny", rank=4).result()
    local = core.ServiceClient(root=tmp_path, resident=resident).create_lora_training_client(base_model="tiny", rank=4)
    prompt = [0, 10, 11, 12]
    params = types.SamplingParams(max_tokens=4, seed=11, temperature=1.0)
    for step in range(2):
        sampler = tc.save_weights_and_get_sampling_client().result()  # the SDK's in-loop snapshot sampler
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), 4, params).result().sequences
        local_sampled = local.save_weights_and_get_sampling_client().sample(
            core.types.ModelInput.from_ints(prompt), 4, core.types.SamplingParams(max_tokens=4, seed=11)).result()
        assert [list(s.tokens) for s in sampled] == [s.tokens for s in local_sampled.sequences]
        np.testing.assert_array_equal(np.concatenate([s.logprobs for s in sampled]).astype(np.float32),
                                      np.concatenate([s.logprobs for s in local_sampled.sequences]).astype(np.float32))
        data, _ = rl_batch(types, sampled, prompt)
        local_data, _ = rl_batch(core.types, local_sampled.sequences, prompt)
        out = tc.forward_backward(data, loss_fn).result()
        ref = local.forward_backward(local_data, loss_fn).result()
        assert np.isfinite(out.metrics["loss:sum"]) and out.metrics["loss:sum"] == ref.metrics["loss:sum"]
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        local.optim_step(core.types.AdamParams(learning_rate=2e-2)).result()
    # the update moved the policy: the first sampled sequence's log-probs changed under the trained weights
    after = tc.forward(data[:1], loss_fn).result().loss_fn_outputs[0]["logprobs"].to_numpy()
    before = data[0].loss_fn_inputs["logprobs"].to_numpy()
    assert not np.array_equal(after[len(prompt) - 1:], before[len(prompt) - 1:])
