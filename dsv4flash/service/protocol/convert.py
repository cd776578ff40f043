"""Requests in (token ids of a ModelInput, the optimizer type, TTLs) and results out as protobuf or JSON answers
(the core speaks `tinker.types` itself, so nothing is converted between type families)."""

from __future__ import annotations

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


def adam_params(p) -> core.AdamParams:
    """The request's optimizer parameters, which must be Adam's (400 naming the type otherwise)."""
    if not isinstance(p, core.AdamParams):
        raise BadRequest(f"optim_params: {type(p).__name__} is not supported (AdamParams only)")
    return p


def ttl_seconds(body: dict) -> int | None:
    """The `ttl_seconds` of a JSON body as sent (`request.state.json`), checked; BadRequest naming the field."""
    # The body as sent, not the validated model: validation turns `true` into 1 and "60" into 60.
    from dsv4flash.service.plane.checkpoints import check_ttl

    try:
        return check_ttl(body.get("ttl_seconds"), integer=True)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc


def error_category(exc: BaseException) -> str:
    """`user` for errors in the request (bad values, unknown names) and cancelled requests, `server` otherwise
    (a request stopped at the per-call deadline included: nothing was wrong with it, so retrying may succeed)."""
    from dsv4flash.service.calls import CallCancelled

    user = (ValueError, KeyError, TypeError, FileNotFoundError, LookupError, CallCancelled)
    return "user" if isinstance(exc, user) else "server"


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
