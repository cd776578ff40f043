"""Fault cases of the policy service core (`TrainingClient`, `SamplingClient`): malformed data, out-of-range
parameters, and non-finite losses, gradients and updates — each refused with the adapter left unchanged."""

from __future__ import annotations

import math

from dsv4flash.faultcases import DataLost, SilentWrong, case

TOKENS = [0, 5, 6, 7, 8, 9]


# ------------------------------------------------------------------------------------------ helpers
def _datum(tokens=TOKENS, **inputs):
    from dsv4flash.service import types

    defaults = dict(target_tokens=tokens[1:], weights=[1.0] * (len(tokens) - 1))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={**defaults, **inputs})


def _rl_datum(**inputs):
    n = len(TOKENS) - 1
    return _datum(**{"logprobs": [-1.0] * n, "advantages": [0.5, -0.5, 1.0, 0.0, 2.0], **inputs})


def _trainer(ctx):
    return ctx.service().create_lora_training_client(rank=2, preset="decoder_half", seed=3)


def _snapshot(tc) -> dict:
    return {k: p.detach().clone() for k, p in tc.adapter.items()}


def _grads(tc) -> dict:
    return {k: None if p.grad is None else p.grad.clone() for k, p in tc.adapter.items()}


def _unchanged(tc, weights: dict, grads: dict | None = None) -> None:
    """The adapter (and its accumulated gradients) are exactly as before; otherwise a silent change."""
    import torch

    for k, p in tc.adapter.items():
        if not torch.equal(p.detach(), weights[k]):
            raise SilentWrong(f"adapter tensor {k} changed although the call was refused")
    if grads is not None:
        for k, p in tc.adapter.items():
            same = (p.grad is None and grads[k] is None) or (p.grad is not None and grads[k] is not None
                                                             and torch.equal(p.grad, grads[k]))
            if not same:
                raise SilentWrong(f"the accumulated gradient of {k} changed although the call was refused")


def _refused_training(ctx, call) -> object:
    """Run `call(tc)` on a trainer that has one accumulated backward; it must fail and change nothing."""
    tc = _trainer(ctx)
    tc.forward_backward([_datum()], "cross_entropy").result()
    weights, grads = _snapshot(tc), _grads(tc)
    failure = ctx.must_fail(lambda: call(tc))
    _unchanged(tc, weights, grads)
    return failure


def _sampler(ctx):
    return ctx.service().create_sampling_client(base_model="tiny")


def _sample(ctx, prompt=(0, 5, 6), n: int = 1, **params):
    from dsv4flash.service import types

    sc = _sampler(ctx)
    return sc.sample(types.ModelInput.from_ints(list(prompt)), n, types.SamplingParams(**params)).result()


# ------------------------------------------------------------------------------------------ forward_backward inputs
@case("service", "NaN in weights is refused naming datum, key and position",
      match=r"datum 0: loss_fn_inputs\['weights'\] position 2 is nan")
def nan_weights(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_datum(weights=[1.0, 1.0, math.nan, 1.0, 1.0])], "cross_entropy").result())


@case("service", "NaN advantages are refused (importance_sampling)",
      match=r"datum 1: loss_fn_inputs\['advantages'\] position 0 is nan")
def nan_advantages(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_rl_datum(), _rl_datum(advantages=[math.nan, 0, 0, 0, 0])], "importance_sampling").result())


@case("service", "infinite advantages are refused (ppo)", match=r"loss_fn_inputs\['advantages'\] position 4 is inf")
def inf_advantages(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_rl_datum(advantages=[0, 0, 0, 0, math.inf])], "ppo").result())


@case("service", "NaN sampler logprobs are refused (cispo)", match=r"loss_fn_inputs\['logprobs'\] position 1 is nan")
def nan_logprobs(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_rl_datum(logprobs=[-1.0, math.nan, -1.0, -1.0, -1.0])], "cispo").result())


@case("service", "weights shorter than the targets", match=r"datum 0: loss_fn_inputs\['weights'\] has shape \[3\], "
      r"expected \[5\]")
def short_weights(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward([_datum(weights=[1.0, 1.0, 1.0])],
                                                                 "cross_entropy").result())


@case("service", "2-D target_tokens are refused, not flattened",
      match=r"loss_fn_inputs\['target_tokens'\] has shape \[1, 5\], expected \[5\]")
def target_tokens_2d(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward([_datum(target_tokens=[TOKENS[1:]])],
                                                                 "cross_entropy").result())


@case("service", "a model_input token id ≥ vocab names datum and position",
      match=r"datum 1: model_input position 3: token id 512 is not an integer in \[0, 512\)")
def input_token_out_of_vocab(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_datum(), _datum([0, 5, 6, 512, 8, 9])], "cross_entropy").result())


@case("service", "a target token id ≥ vocab names datum and position",
      match=r"datum 0: target_tokens position 4: token id 100000")
def target_token_out_of_vocab(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_datum(target_tokens=[5, 6, 7, 8, 100000])], "cross_entropy").result())


@case("service", "a negative token id", match=r"model_input position 0: token id -1")
def negative_token(ctx):
    return _refused_training(ctx, lambda tc: tc.forward([_datum([-1, 5, 6, 7, 8, 9])], "cross_entropy").result())


@case("service", "float target tokens", match=r"target_tokens position 0: token id 5\.5")
def float_target_tokens(ctx):
    return _refused_training(ctx, lambda tc: tc.forward([_datum(target_tokens=[5.5, 6, 7, 8, 9])],
                                                        "cross_entropy").result())


@case("service", "an empty data list", match=r"empty data list")
def empty_data(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward([], "cross_entropy").result())


@case("service", "an unknown loss function", match=r"loss_fn must be one of")
def unknown_loss(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward([_datum()], "mse").result())


@case("service", "a loss input the loss needs is missing", match=r"needs loss_fn_inputs .* missing \['advantages'\]")
def missing_advantages(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward([_datum(logprobs=[-1.0] * 5)], "ppo").result())


# ------------------------------------------------------------------------------------------ non-finite refusal
@case("service", "a custom loss that is NaN is refused; adapter and gradients unchanged",
      match=r"forward_backward_custom: the loss is nan; refused")
def custom_nan_loss(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward_custom(
        [_datum()], lambda data, lps: (lps[0].sum() * float("nan"), {})).result())


@case("service", "a custom loss with a finite value but an infinite gradient is refused",
      match=r"the gradient of adapter tensor .* is not finite; refused")
def custom_inf_gradient(ctx):
    def loss(data, lps):  # sqrt at 0: value 0, gradient inf
        x = lps[0].sum()
        return (x - x.detach()).abs().sqrt(), {}
    return _refused_training(ctx, lambda tc: tc.forward_backward_custom([_datum()], loss).result())


@case("service", "an update that would be NaN (eps=0 on a zero gradient) is refused; adapter and moments unchanged",
      match=r"optim_step: the update makes adapter tensor .* non-finite; refused")
def nan_update(ctx):
    from dsv4flash.service import types

    return _refused_training(ctx, lambda tc: tc.optim_step(types.AdamParams(learning_rate=1e-3, eps=0.0)).result())


@case("service", "after a refused update the next valid step and save_state work and are finite",
      expect="correct result")
def refused_update_then_recover(ctx):
    import torch

    from dsv4flash.service import types

    tc = _trainer(ctx)
    tc.forward_backward([_datum()], "cross_entropy").result()
    before = _snapshot(tc)
    try:
        tc.optim_step(types.AdamParams(learning_rate=1e-3, eps=0.0)).result()
    except ValueError:
        pass
    else:
        raise SilentWrong("the NaN update was accepted")
    if tc.optimizer is not None:
        raise SilentWrong("a refused first step left an optimizer state behind")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    if step.metrics["step"] != 1.0:
        raise SilentWrong(f"the step counter moved on the refused update: {step.metrics}")
    if all(torch.equal(before[k], p.detach()) for k, p in tc.adapter.items()):
        raise SilentWrong("the valid step did not update the adapter")
    path = tc.save_state("after").result().path
    tensors, _, _ = tc.service._read_checkpoint(path, False)
    if not all(torch.isfinite(t).all() for t in tensors.values()):
        raise DataLost("save_state stored non-finite weights")
    if not all(torch.equal(tensors[k], p.detach()) for k, p in tc.adapter.items()):
        raise DataLost("save_state stored other weights than the adapter holds")


@case("service", "sampler logprobs so low that the importance ratio overflows: the infinite loss is refused",
      match=r"forward_backward\('importance_sampling'\): the loss is -inf; refused")
def overflowing_ratio(ctx):
    return _refused_training(ctx, lambda tc: tc.forward_backward(
        [_rl_datum(logprobs=[-1e30] * 5, advantages=[1.0] * 5)], "importance_sampling").result())


@case("service", "a NaN learning rate is refused before touching the adapter", match=r"AdamParams\.learning_rate")
def nan_learning_rate(ctx):
    from dsv4flash.service import types

    return _refused_training(ctx, lambda tc: tc.optim_step(types.AdamParams(learning_rate=math.nan)).result())


@case("service", "beta1 = 1 is refused", match=r"AdamParams\.beta1: expected a finite number in \[0\.0, 1\.0\)")
def beta_one(ctx):
    from dsv4flash.service import types

    return _refused_training(ctx, lambda tc: tc.optim_step(types.AdamParams(beta1=1.0)).result())


@case("service", "a negative grad_clip_norm is refused", match=r"AdamParams\.grad_clip_norm")
def negative_clip(ctx):
    from dsv4flash.service import types

    return _refused_training(ctx, lambda tc: tc.optim_step(types.AdamParams(grad_clip_norm=-1.0)).result())


# ------------------------------------------------------------------------------------------ sampling
@case("service", "max_tokens = -1 is refused (it returned 0 tokens)", match=r"SamplingParams\.max_tokens: expected an "
      r"integer ≥ 1")
def max_tokens_negative(ctx):
    return ctx.must_fail(lambda: _sample(ctx, max_tokens=-1))


@case("service", "max_tokens = 0 is refused", match=r"SamplingParams\.max_tokens")
def max_tokens_zero(ctx):
    return ctx.must_fail(lambda: _sample(ctx, max_tokens=0))


@case("service", "temperature = NaN is refused", match=r"SamplingParams\.temperature: expected a finite number ≥ 0, "
      r"got nan")
def temperature_nan(ctx):
    return ctx.must_fail(lambda: _sample(ctx, temperature=math.nan))


@case("service", "temperature = inf is refused", match=r"SamplingParams\.temperature: .* got inf")
def temperature_inf(ctx):
    return ctx.must_fail(lambda: _sample(ctx, temperature=math.inf))


@case("service", "a negative temperature is refused", match=r"SamplingParams\.temperature")
def temperature_negative(ctx):
    return ctx.must_fail(lambda: _sample(ctx, temperature=-0.5))


@case("service", "top_p = 0 is refused", match=r"SamplingParams\.top_p: expected a number in \(0, 1\]")
def top_p_zero(ctx):
    return ctx.must_fail(lambda: _sample(ctx, top_p=0.0))


@case("service", "top_k = -5 is refused", match=r"SamplingParams\.top_k")
def top_k_negative(ctx):
    return ctx.must_fail(lambda: _sample(ctx, top_k=-5))


@case("service", "a prompt token id ≥ vocab names the position", match=r"sample: prompt position 1: token id 999")
def prompt_out_of_vocab(ctx):
    return ctx.must_fail(lambda: _sample(ctx, prompt=(0, 999, 3)))


@case("service", "compute_logprobs with a token id ≥ vocab names the position",
      match=r"compute_logprobs: prompt position 2: token id 4096")
def logprobs_out_of_vocab(ctx):
    from dsv4flash.service import types

    return ctx.must_fail(lambda: _sampler(ctx).compute_logprobs(types.ModelInput.from_ints([0, 1, 4096])).result())


@case("service", "num_samples = 0 is refused", match=r"num_samples must be ≥ 1")
def zero_samples(ctx):
    return ctx.must_fail(lambda: _sample(ctx, n=0))


@case("service", "an empty prompt is refused", match=r"sample: empty prompt")
def empty_prompt(ctx):
    return ctx.must_fail(lambda: _sample(ctx, prompt=()))


@case("service", "shared-encoder sampling validates before its prefill",
      match=r"sample: prompt position 0: token id 777")
def shared_sampling_out_of_vocab(ctx):
    from dsv4flash.service import types
    from dsv4flash.service.compute.shared_sampling import sample_shared

    tc = _trainer(ctx)
    sc = tc.save_weights_and_get_sampling_client()
    return ctx.must_fail(lambda: sample_shared([sc], types.ModelInput.from_ints([777, 1]), 1,
                                               types.SamplingParams(max_tokens=2)).results())


@case("service", "greedy sampling with valid parameters returns max_tokens finite log-probs (control)",
      expect="correct result")
def greedy_control(ctx):
    out = _sample(ctx, max_tokens=3, temperature=0.0)
    seq = out.sequences[0]
    if len(seq.tokens) != 3 and seq.stop_reason != "stop":
        raise SilentWrong(f"asked for 3 tokens, got {len(seq.tokens)} ({seq.stop_reason})")
    if not all(math.isfinite(x) and x <= 0 for x in seq.logprobs):
        raise SilentWrong(f"log-probs not finite and ≤ 0: {seq.logprobs}")


@case("service", "load_state of a path that was never saved", match=r"not in the store")
def load_missing_state(ctx):
    return _refused_training(ctx, lambda tc: tc.load_state(f"tinker://{tc.run_id}/weights/never").result())


@case("service", "load_state of a malformed path", match=r"expected tinker://<run>/weights/<name>")
def load_bad_path(ctx):
    return _refused_training(ctx, lambda tc: tc.load_state("s3://bucket/key").result())
