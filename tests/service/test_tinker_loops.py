"""Tinker-cookbook-style loops run against our client with only the import changed."""

import numpy as np

import dsv4flash.service as tinker
from dsv4flash.service import types


def _sl_datum(tokens, prompt_len):
    # cookbook: weights 0 on the prompt, 1 on the completion; inputs/targets shifted by one
    weights = [0] * prompt_len + [1] * (len(tokens) - prompt_len)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]))


def test_supervised_loop(resident, tmp_path):
    service_client = tinker.ServiceClient(root=tmp_path, resident=resident)
    training_client = service_client.create_lora_training_client(base_model="tiny", rank=4, preset="decoder_half")
    examples = [_sl_datum([0, 10, 11, 12, 20, 21, 22, 1], 4), _sl_datum([0, 13, 14, 15, 23, 24, 25, 1], 4)]
    losses = []
    for _ in range(6):
        fwdbwd_future = training_client.forward_backward(examples, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=5e-3))
        fwdbwd_result = fwdbwd_future.result()
        optim_future.result()
        logprobs = np.concatenate([o["logprobs"].tolist() for o in fwdbwd_result.loss_fn_outputs])
        weights = np.concatenate([e.loss_fn_inputs["weights"].tolist() for e in examples])
        losses.append(-np.dot(logprobs, weights) / weights.sum())
    assert losses[-1] < losses[0] - 0.1, losses
    path = training_client.save_weights_for_sampler(name="final").result().path
    assert path == f"tinker://{training_client.run_id}/sampler_weights/final"
    sampling_client = service_client.create_sampling_client(model_path=path)
    lp = sampling_client.compute_logprobs(types.ModelInput.from_ints([0, 10, 11, 12, 20])).result()
    assert lp[0] is None and len(lp) == 5 and all(x <= 0 for x in lp[1:])


def test_rl_loop(resident, tmp_path):
    service_client = tinker.ServiceClient(root=tmp_path, resident=resident)
    training_client = service_client.create_lora_training_client(base_model="tiny", rank=4, preset="decoder_half", seed=3)
    prompt = types.ModelInput.from_ints([0, 30, 31, 32])
    group_size = 4
    mean_rewards = []
    for step in range(4):
        sampling_client = training_client.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=3, temperature=1.0, stop=[1], seed=step)
        result = sampling_client.sample(prompt=prompt, num_samples=group_size, sampling_params=params).result()
        rewards = [float(seq.tokens[0] % 2 == 0) + seq.tokens[0] / 1000 for seq in result.sequences]  # a toy env
        mean = sum(rewards) / len(rewards)
        mean_rewards.append(mean)
        advantages = [r - mean for r in rewards]
        datums = []
        for seq, adv in zip(result.sequences, advantages):
            toks = prompt.to_ints() + seq.tokens
            ob_len = prompt.length - 1
            datums.append(types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs=dict(target_tokens=toks[1:], logprobs=[0.0] * ob_len + seq.logprobs,
                                    advantages=[0.0] * ob_len + [adv] * len(seq.tokens))))
        if all(a == 0 for a in advantages):
            continue
        fb = training_client.forward_backward(datums, loss_fn="importance_sampling")
        opt = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result()
        opt.result()
        # on-policy: the trainer's log-probs of the sampled tokens equal the sampler's
        for o, seq in zip(out.loss_fn_outputs, result.sequences):
            got = o["logprobs"].tolist()[-len(seq.tokens):]
            np.testing.assert_allclose(got, seq.logprobs, atol=1e-4)
    state = training_client.save_state("rl-final").result()
    assert state.path.endswith("/weights/rl-final")
    assert training_client.step >= 3
