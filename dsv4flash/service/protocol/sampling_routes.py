"""Sampling of the Tinker protocol: sampling sessions, sampler info, asample (session, checkpoint path or base)."""

from __future__ import annotations

import asyncio
import uuid

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dsv4flash.service.plane.policy_server import BadRequest
from dsv4flash.service.protocol import convert
from dsv4flash.service.protocol.http import (future_response, guarded, model_json, parse, plane_of,
                                             require_room, tenant_of, tinker_types)


async def create_sampling_session(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().CreateSamplingSessionRequest)
    plane = plane_of(request)
    sid = await asyncio.to_thread(plane.create_sampler, tenant, req.session_id, req.model_path, req.base_model)
    return model_json(tinker_types().CreateSamplingSessionResponse(sampling_session_id=sid))


async def join_sampling_session(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().JoinSamplingSessionRequest)
    n = plane_of(request).join_sampler(tenant, req.sampling_session_id)
    return model_json(tinker_types().JoinSamplingSessionResponse(client_counter=n))


async def get_sampler(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = plane_of(request)
    s = plane.sampler(tenant, request.path_params["sampler_id"])
    return model_json(tinker_types().GetSamplerResponse(
        sampler_id=s.sampler_id, base_model=plane.served_base_name, model_path=s.model_path))


CLONE_SEQ_STRIDE = 1_000_000_000  # the SDK numbers clone k's requests from k * 1e9 (cloned_sampler_id)

_UNSUPPORTED_SAMPLE = {"target_prompt_logprobs": None,
                       "prompt_alt_tokens_k": 0, "prompt_logprobs_last_n": None}


async def asample(request: Request) -> Response:
    tenant = tenant_of(request)
    await require_room(request, tenant)
    req = await parse(request, tinker_types().SampleRequest)
    plane = plane_of(request)
    for name, default in _UNSUPPORTED_SAMPLE.items():
        if getattr(req, name) != default:
            raise BadRequest(f"{name}: not supported by this server (leave it at {default!r})")
    session = None
    if req.sampling_session_id is not None:
        session = plane.sampler(tenant, req.sampling_session_id)
        client = session.client
    else:  # stateless: a checkpoint path, or the bare base
        if req.model_path is not None:
            plane.require_readable(tenant, req.model_path)
        client = await asyncio.to_thread(plane.path_sampler, tenant, req.model_path)
    if req.num_samples < 1:
        raise BadRequest(f"num_samples: must be at least 1, got {req.num_samples}")
    prompt = convert.tokens_of(req.prompt, "prompt")
    params = req.sampling_params
    from dsv4flash.service.compute.sampling import check_sample_request
    from dsv4flash.service.types import ModelInput

    text = plane.service.base.cfg.text
    try:  # now, as a 400, not when it runs: a prompt or max_tokens past the context, a bad parameter
        check_sample_request(prompt, req.num_samples, params, text.vocab_size, text.max_position_embeddings)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc

    k, k_prompt = req.topk_sample_logprobs or 0, req.topk_prompt_logprobs or 0
    for name, value in (("topk_sample_logprobs", k), ("topk_prompt_logprobs", k_prompt)):
        if value < 0:
            raise BadRequest(f"{name}: must be ≥ 0, got {value}")
    stem = uuid.uuid4().hex  # ids known before the work runs: the SDK reads them off the promise
    sequence_ids = [f"{stem}:{i}" for i in range(req.num_samples)]
    rid = plane.submit(tenant, "sample", lambda: client.sample(
        ModelInput.from_ints(prompt), req.num_samples, params, include_prompt_logprobs=bool(req.prompt_logprobs),
        topk_prompt_logprobs=k_prompt, topk_sample_logprobs=k, record_stability_info=bool(req.record_stability_info),
        sequence_ids=sequence_ids, owner=tenant), convert.sample_result)
    if session is not None:  # the SDK's session poller (retrieve_futures) learns of it from its clone's queue
        session.completion_queue((req.seq_id or 0) // CLONE_SEQ_STRIDE).watch(rid, plane.ops.get(rid, tenant).future)
    return future_response(rid, sample_sequence_ids=sequence_ids)


ROUTES = [
    Route("/api/v1/create_sampling_session", guarded(create_sampling_session), methods=["POST"]),
    Route("/api/v1/join_sampling_session", guarded(join_sampling_session), methods=["POST"]),
    Route("/api/v1/samplers/{sampler_id}", guarded(get_sampler), methods=["GET"]),
    Route("/api/v1/asample", guarded(asample), methods=["POST"]),
]
