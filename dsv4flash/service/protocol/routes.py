"""The Tinker REST protocol (SDK 0.38): set-up, sessions, training, sampling and futures, under `/api/v1`.

Request and response schemas are `tinker.types` models; forward_backward bodies and the results of
forward_backward / sample are the SDK's protobuf messages. Every handler validates, checks the tenant through
the `PolicyServer` and queues core work as an operation whose id the client polls with `retrieve_future`.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsv4flash.service.plane.policy_server import BadRequest
from dsv4flash.service.protocol import convert, wire
from dsv4flash.service.protocol.http import error_response, guarded, model_json, parse, read_body, tenant_of


def _types():
    from tinker import types

    return types


def _plane(request: Request):
    return request.app.state.plane


def _future(request_id: str, **extra) -> JSONResponse:
    return model_json(_types().UntypedAPIFuture(request_id=request_id, **extra))


def _json_result(model):
    return lambda result, proto: model(result).model_dump(mode="json", exclude_none=True)


# ---- set-up and sessions ----
async def healthz(request: Request) -> Response:
    return model_json(_types().HealthResponse(status="ok"))


async def client_config(request: Request) -> Response:
    tenant_of(request)
    # Key -> JWT exchange (what lets MinT's sk- keys through its patched auth); httpx transport; chunks in
    # order; zstd-compressed protobuf bodies.
    return model_json(_types().ClientConfigResponse(
        pjwt_auth_enabled=True, use_pyqwest_transport=False, parallel_fwdbwd_chunks=False,
        proto_compress_fwdbwd=True))


async def auth_token(request: Request) -> Response:
    tenant = tenant_of(request)
    await read_body(request)
    return model_json(_types().AuthTokenResponse(jwt=request.app.state.tokens.issue(tenant)))


async def client_dynamic_config(request: Request) -> Response:
    tenant_of(request)
    return model_json(_types().ClientDynamicConfigResponse(sample_cancel_enabled=True))


async def create_session(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().CreateSessionRequest)
    sid = _plane(request).create_session(tenant, req.user_metadata)
    return model_json(_types().CreateSessionResponse(session_id=sid))


async def session_heartbeat(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().SessionHeartbeatRequest)
    _plane(request).heartbeat(tenant, req.session_id)
    return model_json(_types().SessionHeartbeatResponse())


async def finish_session(request: Request) -> Response:
    tenant = tenant_of(request)
    await read_body(request)
    _plane(request).finish_session(tenant, request.path_params["session_id"])
    return JSONResponse({})


async def capabilities(request: Request) -> Response:
    tenant_of(request)
    t = _types()
    base = _plane(request).service.base
    return model_json(t.GetServerCapabilitiesResponse(supported_models=[t.SupportedModel(
        model_name=base.base_model, max_context_length=int(base.cfg.text.max_position_embeddings),
        trainable=True, sampleable=True)]))


async def telemetry(request: Request) -> Response:
    tenant_of(request)
    await read_body(request)  # accepted and dropped: a local server keeps no client telemetry
    return model_json(_types().TelemetryResponse(status="accepted"))


# ---- training ----
def _lora_kwargs(lora) -> dict:
    if lora is None:
        return {}
    out = {"rank": int(lora.rank), "train_mlp": lora.train_mlp, "train_attn": lora.train_attn,
           "train_unembed": lora.train_unembed}
    if lora.seed is not None:
        out["seed"] = int(lora.seed)
    return out


async def create_model(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().CreateModelRequest)
    plane = _plane(request)
    plane.session(tenant, req.session_id)
    if req.base_model != plane.service.base.base_model:
        raise BadRequest(f"base_model: {req.base_model!r} is not served here (the resident base is "
                         f"{plane.service.base.base_model!r})")
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    rid = plane.submit(tenant, "create_model",
                       lambda: plane.in_pool(plane.create_model, tenant, req.session_id, req.model_seq_id,
                                             req.base_model, _lora_kwargs(req.lora_config), req.user_metadata),
                       _json_result(lambda mid: _types().CreateModelResponse(model_id=mid)))
    return _future(rid, model_id=model_id)


async def get_info(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().GetInfoRequest)
    plane = _plane(request)
    tc = plane.model(tenant, req.model_id)
    t = _types()
    base = plane.service.base
    return model_json(t.GetInfoResponse(
        type="get_info", model_id=req.model_id, is_lora=True, lora_rank=int(tc.placement.rank),
        model_name=base.base_model,
        model_data=t.ModelData(arch=str(base.cfg.model_type), model_name=base.base_model,
                               tokenizer_id=plane.tokenizer_dir)))


async def _fwd_body(request: Request, input_key: str):
    """(model_id, forward_only, loss_fn, config, data) from the SDK 0.38 protobuf body or an older SDK's JSON."""
    body = wire.decompress(await read_body(request), request.headers.get("content-encoding"),
                           limit=request.app.state.max_body)
    if "protobuf" in request.headers.get("content-type", ""):
        model_id, _seq, forward_only, loss_fn, config, data = wire.decode_forward_backward(body)
        return model_id, forward_only or input_key == "forward_input", loss_fn, config, data
    import json

    try:
        parsed = json.loads(body or b"{}")
    except ValueError as exc:
        raise BadRequest(f"body: neither protobuf (Content-Type: application/x-protobuf) nor JSON ({exc})") from exc
    model_id, _seq, loss_fn, config, data = wire.decode_forward_backward_json(parsed, input_key)
    return model_id, input_key == "forward_input", loss_fn, config, data


async def forward_backward(request: Request) -> Response:
    return await _run_forward(request, "forward_backward_input")


async def forward(request: Request) -> Response:
    return await _run_forward(request, "forward_input")


async def _run_forward(request: Request, input_key: str) -> Response:
    tenant = tenant_of(request)
    plane = _plane(request)
    model_id, forward_only, loss_fn, config, data = await _fwd_body(request, input_key)
    tc = plane.model(tenant, model_id)
    call = tc.forward if forward_only else tc.forward_backward
    rid = plane.submit(tenant, "forward" if forward_only else "forward_backward",
                       lambda: call(data, loss_fn, config or None), convert.forward_backward_result)
    return _future(rid, model_id=model_id)


async def optim_step(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().OptimStepRequest)
    plane = _plane(request)
    tc = plane.model(tenant, req.model_id)
    hp = convert.adam_params(req.optim_params)
    rid = plane.submit(tenant, "optim_step", lambda: tc.optim_step(hp),
                       _json_result(lambda r: _types().OptimStepResponse(metrics=r.metrics)))
    return _future(rid, model_id=req.model_id)


async def save_weights(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().SaveWeightsRequest)
    plane = _plane(request)
    tc = plane.model(tenant, req.model_id)
    name = req.path or f"step-{tc.step:06d}"
    rid = plane.submit(tenant, "save_weights", lambda: tc.save_state(name, req.ttl_seconds, req.overwrite),
                       _json_result(lambda r: _types().SaveWeightsResponse(path=r.path, type="save_weights")))
    return _future(rid, model_id=req.model_id)


async def save_weights_for_sampler(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().SaveWeightsForSamplerRequest)
    plane = _plane(request)
    tc = plane.model(tenant, req.model_id)
    t = _types()
    if req.path is not None:
        rid = plane.submit(tenant, "save_weights_for_sampler",
                           lambda: tc.save_weights_for_sampler(req.path, req.ttl_seconds),
                           _json_result(lambda r: t.SaveWeightsForSamplerResponseInternal(
                               path=r.path, type="save_weights_for_sampler")))
        return _future(rid, model_id=req.model_id)
    if req.kind != "snapshot":
        raise BadRequest(f"kind: {req.kind!r} sampling clients are not supported (snapshot only)")
    # No name: an ephemeral snapshot of the weights after every queued call, served as a sampling session.
    rid = plane.submit(tenant, "save_weights_for_sampler", tc.snapshot_sampling_client,
                       _json_result(lambda sc: t.SaveWeightsForSamplerResponseInternal(
                           sampling_session_id=plane.add_sampler(tenant, req.model_id.split(":")[0], sc, None),
                           type="save_weights_for_sampler")))
    return _future(rid, model_id=req.model_id)


async def load_weights(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().LoadWeightsRequest)
    plane = _plane(request)
    t = _types()
    encode = _json_result(lambda r: t.LoadWeightsResponse(path=r[0], model_id=r[1], type="load_weights"))
    if req.model_id is None:  # create_training_client_from_state*: a new run loaded in one request
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequest("model_id: give model_id, or session_id and model_seq_id for a new run")
        plane.require_readable(tenant, req.path)
        rid = plane.submit(tenant, "load_weights",
                           lambda: plane.in_pool(plane.create_model_from_state, tenant, req.session_id,
                                                 req.model_seq_id, req.path, req.optimizer, req.user_metadata),
                           encode)
        return _future(rid, model_id=f"{req.session_id}:train:{req.model_seq_id}")
    tc = plane.model(tenant, req.model_id)
    plane.require_readable(tenant, req.path)
    load = tc.load_state_with_optimizer if req.optimizer else tc.load_state
    rid = plane.submit(tenant, "load_weights", lambda: load(req.path),
                       lambda r, proto: t.LoadWeightsResponse(path=r.path, model_id=req.model_id,
                                                              type="load_weights").model_dump(mode="json"))
    return _future(rid, model_id=req.model_id)


# ---- sampling ----
async def create_sampling_session(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().CreateSamplingSessionRequest)
    plane = _plane(request)
    sid = await asyncio.to_thread(plane.create_sampler, tenant, req.session_id, req.model_path, req.base_model)
    return model_json(_types().CreateSamplingSessionResponse(sampling_session_id=sid))


async def join_sampling_session(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().JoinSamplingSessionRequest)
    n = _plane(request).join_sampler(tenant, req.sampling_session_id)
    return model_json(_types().JoinSamplingSessionResponse(client_counter=n))


async def get_sampler(request: Request) -> Response:
    tenant = tenant_of(request)
    plane = _plane(request)
    s = plane.sampler(tenant, request.path_params["sampler_id"])
    return model_json(_types().GetSamplerResponse(sampler_id=s.sampler_id, base_model=plane.service.base.base_model,
                                                  model_path=s.model_path))


_UNSUPPORTED_SAMPLE = {"topk_prompt_logprobs": 0, "topk_sample_logprobs": 0, "target_prompt_logprobs": None,
                       "prompt_alt_tokens_k": 0, "prompt_logprobs_last_n": None}


async def asample(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().SampleRequest)
    plane = _plane(request)
    for name, default in _UNSUPPORTED_SAMPLE.items():
        if getattr(req, name) != default:
            raise BadRequest(f"{name}: not supported by this server (leave it at {default!r})")
    if req.sampling_session_id is not None:
        client = plane.sampler(tenant, req.sampling_session_id).client
    else:  # stateless: a checkpoint path, or the bare base
        if req.model_path is not None:
            plane.require_readable(tenant, req.model_path)
        client = await asyncio.to_thread(plane.path_sampler, req.model_path)
    if req.num_samples < 1:
        raise BadRequest(f"num_samples: must be at least 1, got {req.num_samples}")
    prompt = convert.tokens_of(req.prompt, "prompt")
    params = convert.sampling_params(req.sampling_params)
    from dsv4flash.service.types import ModelInput

    rid = plane.submit(tenant, "sample", lambda: client.sample(ModelInput.from_ints(prompt), req.num_samples, params,
                                                               include_prompt_logprobs=bool(req.prompt_logprobs)),
                       convert.sample_result)
    return _future(rid, sample_sequence_ids=[f"{rid}:{i}" for i in range(req.num_samples)])


# ---- futures ----
async def retrieve_future(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().FutureRetrieveRequest)
    plane = _plane(request)
    try:
        op = plane.ops.get(req.request_id, tenant)
    except KeyError:
        # Never issued to this tenant, expired, or lost in a restart: the SDK resubmits on 410.
        return error_response(410, f"request {req.request_id} is unknown to this server (expired, or issued "
                                   f"before a restart): resubmit it")
    fut = op.future
    if not fut.done():
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), request.app.state.poll_s)
        except (asyncio.TimeoutError, Exception):
            pass  # still running, or failed: either is answered below from the future itself
    if not fut.done():
        queued = plane.ops.pending(tenant)
        from tinker.types.try_again_response import TryAgainResponse

        body = TryAgainResponse(request_id=req.request_id, queue_state="active").model_dump(mode="json")
        if not fut.running():  # still waiting behind earlier work: the long poll timed out (HTTP 408)
            body["queue_state_reason"] = f"queued; {queued} unfinished requests of this tenant"
            return JSONResponse(body, status_code=408)
        return JSONResponse(body)
    if fut.cancelled():
        return JSONResponse({"error": f"request {req.request_id} was cancelled", "category": "user"})
    exc = fut.exception()
    if exc is not None:
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}", "category": convert.error_category(exc)})
    want_proto = "application/x-protobuf" in request.headers.get("accept", "")
    out = op.encode(fut.result(), want_proto)
    if isinstance(out, bytes):
        return Response(out, media_type=wire.PROTO_CONTENT_TYPE)
    return JSONResponse(out)


async def cancel_future(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, _types().FutureRetrieveRequest)
    try:
        _plane(request).ops.cancel(req.request_id, tenant)
    except KeyError:
        pass  # cancelling what is already gone is a no-op
    return JSONResponse({})


ROUTES = [
    Route("/api/v1/healthz", guarded(healthz), methods=["GET"]),
    Route("/api/v1/client/config", guarded(client_config), methods=["POST"]),
    Route("/api/v1/client/dynamic_config", guarded(client_dynamic_config), methods=["POST"]),
    Route("/api/v1/auth/token", guarded(auth_token), methods=["POST"]),
    Route("/api/v1/create_session", guarded(create_session), methods=["POST"]),
    Route("/api/v1/session_heartbeat", guarded(session_heartbeat), methods=["POST"]),
    Route("/api/v1/sessions/{session_id}/finish", guarded(finish_session), methods=["POST"]),
    Route("/api/v1/get_server_capabilities", guarded(capabilities), methods=["GET"]),
    Route("/api/v1/telemetry", guarded(telemetry), methods=["POST"]),
    Route("/api/v1/create_model", guarded(create_model), methods=["POST"]),
    Route("/api/v1/get_info", guarded(get_info), methods=["POST"]),
    Route("/api/v1/forward_backward", guarded(forward_backward), methods=["POST"]),
    Route("/api/v1/forward", guarded(forward), methods=["POST"]),
    Route("/api/v1/optim_step", guarded(optim_step), methods=["POST"]),
    Route("/api/v1/save_weights", guarded(save_weights), methods=["POST"]),
    Route("/api/v1/save_weights_for_sampler", guarded(save_weights_for_sampler), methods=["POST"]),
    Route("/api/v1/load_weights", guarded(load_weights), methods=["POST"]),
    Route("/api/v1/create_sampling_session", guarded(create_sampling_session), methods=["POST"]),
    Route("/api/v1/join_sampling_session", guarded(join_sampling_session), methods=["POST"]),
    Route("/api/v1/samplers/{sampler_id}", guarded(get_sampler), methods=["GET"]),
    Route("/api/v1/asample", guarded(asample), methods=["POST"]),
    Route("/api/v1/retrieve_future", guarded(retrieve_future), methods=["POST"]),
    Route("/api/v1/cancel_future", guarded(cancel_future), methods=["POST"]),
]
