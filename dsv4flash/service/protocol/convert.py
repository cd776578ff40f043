"""`tinker.types` requests -> service-core arguments, and core results -> `tinker.types` / protobuf answers."""

from __future__ import annotations

import dataclasses

from dsv4flash.service import types as core
from dsv4flash.service.plane.policy_server import BadRequest
from dsv4flash.service.protocol import wire


def tokens_of(model_input, field: str) -> list[int]:
    """Token ids of a `tinker.types.ModelInput` (text chunks only; 400 naming the chunk otherwise)."""
    out: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        if getattr(chunk, "type", None) != "encoded_text":
            raise BadRequest(f"{field}.chunks.{j}: {getattr(chunk, 'type', type(chunk).__name__)} chunks are not "
                             f"supported (text only on this engine)")
        out.extend(int(t) for t in chunk.tokens)
    return out


def sampling_params(p) -> core.SamplingParams:
    """tinker SamplingParams -> core SamplingParams."""
    stop = p.stop if p.stop is None or isinstance(p.stop, str) else list(p.stop)
    return core.SamplingParams(max_tokens=p.max_tokens, seed=p.seed, stop=stop, temperature=float(p.temperature),
                               top_k=int(p.top_k), top_p=float(p.top_p))


def adam_params(p) -> core.AdamParams:
    """tinker AdamParams -> core AdamParams (same field names)."""
    if type(p).__name__ != "AdamParams":
        raise BadRequest(f"optim_params: {type(p).__name__} is not supported (AdamParams only)")
    return core.AdamParams(**{f.name: float(getattr(p, f.name)) for f in dataclasses.fields(core.AdamParams)
                              if getattr(p, f.name, None) is not None})


def error_category(exc: BaseException) -> str:
    """`user` for errors in the request (bad values, unknown names), `server` otherwise."""
    return "user" if isinstance(exc, (ValueError, KeyError, TypeError, FileNotFoundError, LookupError)) else "server"


# ---- results ----
def forward_backward_result(out: core.ForwardBackwardOutput, proto: bool):
    """Protobuf bytes (what SDK 0.38 asks for) or the JSON shape of older SDKs."""
    if proto:
        return wire.encode_forward_backward_output(out)
    return {"loss_fn_output_type": out.loss_fn_output_type, "metrics": dict(out.metrics),
            "loss_fn_outputs": [{k: {"data": v.to_numpy().reshape(-1).tolist(), "dtype": v.dtype, "shape": v.shape}
                                 for k, v in o.items()} for o in out.loss_fn_outputs]}


def sample_result(resp: core.SampleResponse, proto: bool):
    """Protobuf bytes or the JSON SampleResponse."""
    if proto:
        return wire.encode_sample_response(resp)
    return {"type": "sample", "prompt_logprobs": resp.prompt_logprobs,
            "sequences": [{"stop_reason": s.stop_reason, "tokens": list(s.tokens), "logprobs": s.logprobs}
                          for s in resp.sequences]}


def checkpoint(c: core.Checkpoint):
    """core Checkpoint -> tinker.types.Checkpoint."""
    from tinker import types

    return types.Checkpoint(checkpoint_id=c.checkpoint_id, checkpoint_type=c.checkpoint_type, time=c.time,
                            tinker_path=c.tinker_path, size_bytes=c.size_bytes, public=c.public,
                            expires_at=c.expires_at)


def cursor(c: core.Cursor):
    """core Cursor -> tinker.types.Cursor."""
    from tinker import types

    return types.Cursor(offset=c.offset, limit=c.limit, total_count=c.total_count)


def training_run(r: core.TrainingRun, owner: str):
    """core TrainingRun -> tinker.types.TrainingRun (`model_owner` is the tenant)."""
    from tinker import types

    return types.TrainingRun(training_run_id=r.training_run_id, base_model=r.base_model, model_owner=owner,
                             is_lora=r.is_lora, corrupted=r.corrupted, lora_rank=r.lora_rank,
                             last_request_time=r.last_request_time,
                             last_checkpoint=checkpoint(r.last_checkpoint) if r.last_checkpoint else None,
                             last_sampler_checkpoint=(checkpoint(r.last_sampler_checkpoint)
                                                      if r.last_sampler_checkpoint else None),
                             user_metadata={str(k): str(v) for k, v in (r.user_metadata or {}).items()} or None)
