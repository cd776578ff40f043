"""Fault cases of the policy service core (`TrainingClient`, `SamplingClient`): malformed data, out-of-range
parameters, and non-finite losses, gradients and updates — each refused with the adapter left unchanged."""

from __future__ import annotations

import math

from dsv4flash.faultcases import DataLost, LeftBehind, SilentWrong, case

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
    import numpy as np

    # As an array: tinker's own Datum casts a list of numbers to the key's dtype (int64) before any server sees it.
    return _refused_training(ctx, lambda tc: tc.forward([_datum(target_tokens=np.array([5.5, 6, 7, 8, 9]))],
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


# ------------------------------------------------------------------------------------------ careless and hostile clients
def _plane(ctx):
    """A PolicyServer (the HTTP server's plane) over this case's store, and a session of tenant `t` on it."""
    from dsv4flash.service.plane.policy_server import PolicyServer

    plane = PolicyServer(ctx.service(), phase_scheduler=False)
    return plane, plane.create_session("t", None)


_LORA = {"rank": 2, "preset": "decoder_half", "seed": 3}


@case("service", "an empty JWT signing secret is refused, not signed with (any token would verify)",
      match=r"jwt_secret: the JWT signing secret is 0 bytes, expected at least 32")
def empty_jwt_secret(ctx):
    from dsv4flash.service.plane.keys import TokenSigner

    path = ctx.tmp / "jwt_secret"
    path.write_bytes(b"")
    failure = ctx.must_fail(lambda: TokenSigner(path))
    if path.read_bytes():
        raise SilentWrong("the refused secret file was replaced")
    return failure


@case("service", "a retried create_model (same session and model_seq_id) returns the live run, its steps kept",
      expect="correct result")
def retried_create_model(ctx):
    from dsv4flash.service import types

    plane, sid = _plane(ctx)
    try:
        model_id = plane.create_model("t", sid, 0, "tiny", dict(_LORA), None).result()
        tc = plane.model("t", model_id)
        tc.forward_backward([_datum()], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        weights = _snapshot(tc)
        if plane.create_model("t", sid, 0, "tiny", dict(_LORA), None).result() != model_id:
            raise SilentWrong("the retry answered another model id")
        if plane.model("t", model_id) is not tc:
            raise DataLost("the retry replaced the live run: the acknowledged optim_step is gone")
        _unchanged(tc, weights)
    finally:
        plane.close()


@case("service", "another create_model under the same session and model_seq_id is refused",
      match=r"model_seq_id: 0 of session s\w+ already names model s\w+:train:0, created by another request")
def conflicting_create_model(ctx):
    plane, sid = _plane(ctx)
    try:
        model_id = plane.create_model("t", sid, 0, "tiny", dict(_LORA), None).result()
        tc = plane.model("t", model_id)
        failure = ctx.must_fail(lambda: plane.create_model("t", sid, 0, "tiny", {**_LORA, "rank": 4}, None))
        if plane.model("t", model_id) is not tc:
            raise DataLost("the refused request replaced the live run")
        return failure
    finally:
        plane.close()


@case("service", "a checkpoint name deleted and saved again is sampled with its new weights", expect="correct result")
def resaved_name_samples_new_weights(ctx):
    import torch

    from dsv4flash.service import types

    plane, _ = _plane(ctx)
    try:
        service = plane.service
        tc = service.create_lora_training_client(**_LORA)
        path = tc.save_weights_for_sampler("same").result().path
        plane.path_sampler("t", path)  # what a stateless asample by path keeps
        service.delete_checkpoint(path)
        tc.forward_backward([_datum()], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        tc.save_weights_for_sampler("same").result()
        sampler = plane.path_sampler("t", path)
        if not all(torch.equal(sampler.adapter[k], p.detach()) for k, p in tc.adapter.items()):
            raise SilentWrong(f"sampling {path} uses the deleted checkpoint's weights")
    finally:
        plane.close()


@case("service", "an expired checkpoint is not readable through its mint:// spelling",
      match=r"checkpoint mint://\S+/sampler_weights/brief: expired")
def expired_mint_spelling(ctx):
    import time

    tc = _trainer(ctx)
    path = tc.save_weights_for_sampler("brief", ttl_seconds=60).result().path
    tc.service.checkpoints.set(path, ttl_seconds=1, now=time.time() - 10)  # expired nine seconds ago
    return ctx.must_fail(lambda: tc.service.create_sampling_client(path.replace("tinker://", "mint://", 1)))


def _refused_save(ctx, save, tag: str):
    tc = _trainer(ctx)
    failure = ctx.must_fail(lambda: save(tc).result())
    if tag in tc.service.store.catalog.tags(tc.run_id):
        raise LeftBehind(f"the save was refused, but {tag} was published")
    return failure


@case("service", "ttl_seconds = 10**30 is refused before saving (it made every later listing fail)",
      match=r"ttl_seconds: expected a number of seconds in \[1, 315360000\] \(10 years\) or null, got 10{30}")
def huge_ttl(ctx):
    return _refused_save(ctx, lambda tc: tc.save_state("far", ttl_seconds=10**30), "weights.far")


@case("service", "ttl_seconds = True is refused, not taken as 1 second", match=r"ttl_seconds: .* got True")
def bool_ttl(ctx):
    return _refused_save(ctx, lambda tc: tc.save_weights_for_sampler("flag", ttl_seconds=True),
                         "sampler_weights.flag")


@case("service", "a stored expiry no clock reaches (1e30) is logged and ignored; listings still answer",
      expect="correct result")
def unreachable_stored_expiry(ctx):
    import json

    import dsv4flash.service as tinker

    tc = _trainer(ctx)
    path = tc.save_state("kept", ttl_seconds=3600).result().path
    registry = tc.service.state_root / "service" / "checkpoints.json"
    registry.write_text(json.dumps({"checkpoints": {path: {"expires_at": 1e30, "public": False}}}))
    restarted = tinker.ServiceClient(root=tc.service.root, resident=ctx.resident())
    listed = restarted.create_rest_client().list_user_checkpoints().result().checkpoints
    if [c.tinker_path for c in listed] != [path]:
        raise DataLost(f"the listing lost the checkpoint: {[c.tinker_path for c in listed]}")


@case("service", "a corrupted checkpoint is one clear error naming it, from every reader",
      match=r"checkpoint tinker://\S+/weights/hurt: its stored bytes are damaged and cannot be read \(revision blob")
def corrupted_checkpoint(ctx):
    tc = _trainer(ctx)
    service = tc.service
    path = tc.save_state("hurt").result().path
    blob = service.store.blobs.path(service.require_checkpoint(path).id)
    blob.chmod(0o644)
    damaged = bytearray(blob.read_bytes())
    damaged[-1] ^= 0xFF  # tensor data: the header still parses, the hash does not match
    blob.write_bytes(bytes(damaged))
    weights = _snapshot(tc)
    failures = {what: ctx.must_fail(read) for what, read in {
        "sampling": lambda: service.create_sampling_client(path),
        "load_state": lambda: tc.load_state(path).result(),
        "from_state": lambda: service.create_training_client_from_state(path),
        "archive": lambda: service.create_rest_client().get_checkpoint_archive_url_from_tinker_path(path).result(),
    }.items()}
    _unchanged(tc, weights)
    if len({f.message for f in failures.values()}) != 1:
        raise SilentWrong(f"the readers report the damage differently: {[f.message for f in failures.values()]}")
    return failures["sampling"]


def _context(ctx) -> int:
    return ctx.resident().cfg.text.max_position_embeddings


def _long(n: int) -> tuple[int, ...]:
    return tuple(5 + i % 50 for i in range(n))


@case("service", "max_tokens = 10**6 is refused naming the field and the model's context (it ran for minutes)",
      match=r"SamplingParams\.max_tokens: 1000000 is more than the model's context of \d+ tokens")
def max_tokens_past_context(ctx):
    return ctx.must_fail(lambda: _sample(ctx, max_tokens=10**6))


@case("service", "a prompt that with max_tokens does not fit the context is refused naming both lengths",
      match=r"prompt: \d+ tokens \+ max_tokens 8 = \d+, more than the model's context of \d+ tokens")
def prompt_past_context(ctx):
    return ctx.must_fail(lambda: _sample(ctx, prompt=_long(_context(ctx) - 4), max_tokens=8))


@case("service", "compute_logprobs of a prompt longer than the context is refused naming the length",
      match=r"compute_logprobs: prompt: \d+ tokens, more than the model's context of \d+ tokens")
def logprobs_past_context(ctx):
    from dsv4flash.service import types

    prompt = types.ModelInput.from_ints(list(_long(_context(ctx) + 1)))
    return ctx.must_fail(lambda: _sampler(ctx).compute_logprobs(prompt).result())


@case("service", "a training datum longer than the context is refused naming it; adapter and gradients unchanged",
      match=r"data\[1\]\.model_input: \d+ tokens, more than the model's context of \d+ tokens")
def datum_past_context(ctx):
    long = _datum(list(_long(_context(ctx) + 2)))
    return _refused_training(ctx, lambda tc: tc.forward_backward([_datum(), long], "cross_entropy").result())


@case("service", "a zstd body that inflates past the request limit stops there (a 64 KiB body of 512 MiB)",
      match=r"request body decompresses to more than the 1048576-byte request limit")
def compression_bomb(ctx):
    import zstandard

    from dsv4flash.service.protocol.wire import decompress

    compressor = zstandard.ZstdCompressor().compressobj()
    zeros = bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(512)) + compressor.flush()
    return ctx.must_fail(lambda: decompress(bomb, "zstd", limit=1 << 20))
