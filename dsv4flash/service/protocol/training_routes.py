"""Training of the Tinker protocol: create_model, get_info, forward / forward_backward (the SDK's protobuf/zstd
bodies, or older SDKs' JSON), server-side custom losses (create_custom_loss, loss_fn "custom"), optim_step,
save_weights, save_weights_for_sampler, load_weights."""

from __future__ import annotations

import asyncio

import concurrent.futures

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dsv4flash.lifecycle.refs import session_of
from dsv4flash.service.plane.policy_server import BadRequest
from dsv4flash.service.protocol import convert, wire
from dsv4flash.service.protocol.http import (future_response, guarded, json_result, model_json, parse,
                                             plane_of, read_body, require_room, tenant_of, tinker_types)


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
    req = await parse(request, tinker_types().CreateModelRequest)
    plane = plane_of(request)
    plane.session(tenant, req.session_id)
    plane.resolve_base(req.base_model)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    rid = plane.submit(tenant, "create_model",
                       lambda: plane.create_model(tenant, req.session_id, req.model_seq_id, req.base_model,
                                                  _lora_kwargs(req.lora_config), req.user_metadata),
                       json_result(lambda mid: tinker_types().CreateModelResponse(model_id=mid)))
    return future_response(rid, model_id=model_id)


async def get_info(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().GetInfoRequest)
    plane = plane_of(request)
    tc = plane.model(tenant, req.model_id)
    t = tinker_types()
    base = plane.service.base
    name = plane.served_base_name  # the SDK's samplers of this run load their tokenizer by this name
    return model_json(t.GetInfoResponse(
        type="get_info", model_id=req.model_id, is_lora=True, lora_rank=int(tc.placement.rank),
        model_name=name,
        model_data=t.ModelData(arch=str(base.cfg.model_type), model_name=name, tokenizer_id=plane.tokenizer_dir)))


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
    await require_room(request, tenant)
    plane = plane_of(request)
    model_id, forward_only, loss_fn, config, data = await _fwd_body(request, input_key)
    tc = plane.model(tenant, model_id)
    if loss_fn == "custom":  # a loss uploaded with create_custom_loss, run here on live log-probs
        if forward_only:
            raise BadRequest("loss_fn: 'custom' needs forward_backward (forward has no custom-loss form)")
        loss = plane.custom_loss(tenant, model_id, (config or {}).get("loss_id"))
        loss.check_data(data)
        try:
            tc.check_context(data)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        rid = plane.submit(tenant, "forward_backward", lambda: tc.forward_backward_custom(data, loss),
                           convert.forward_backward_result)
        return future_response(rid, model_id=model_id)
    try:  # bad options or provenance: a 400 naming the field now (bad loss inputs fail the future, as in Tinker)
        await asyncio.to_thread(tc.check_options_and_provenance, data, loss_fn, config or None, tenant)
    except (KeyError, ValueError) as exc:
        raise BadRequest(exc.args[0] if exc.args else str(exc)) from exc
    call = tc.forward if forward_only else tc.forward_backward
    rid = plane.submit(tenant, "forward" if forward_only else "forward_backward",
                       lambda: call(data, loss_fn, config or None, owner=tenant), convert.forward_backward_result)
    return future_response(rid, model_id=model_id)


async def create_custom_loss(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().CreateCustomLossRequest)
    plane = plane_of(request)
    from dsv4flash.service.compute.custom_loss import build_custom_loss

    loss = build_custom_loss(req.name, req.inputs, req.graph)  # every node checked before it can run
    loss_id = plane.add_custom_loss(tenant, req.session_id, req.custom_loss_seq_id, loss)
    done = concurrent.futures.Future()
    done.set_result(loss_id)
    rid = plane.submit(tenant, "create_custom_loss", lambda: done,
                       json_result(lambda lid: tinker_types().CreateCustomLossResponse(loss_id=lid)))
    return future_response(rid)


async def optim_step(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().OptimStepRequest)
    plane = plane_of(request)
    tc = plane.model(tenant, req.model_id)
    hp = convert.adam_params(req.optim_params)
    rid = plane.submit(tenant, "optim_step", lambda: tc.optim_step(hp),
                       json_result(lambda r: tinker_types().OptimStepResponse(metrics=r.metrics)))
    return future_response(rid, model_id=req.model_id)


async def save_weights(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().SaveWeightsRequest)
    plane = plane_of(request)
    tc = plane.model(tenant, req.model_id)
    ttl = convert.ttl_seconds(request.state.json)
    name = req.path or f"step-{tc.step:06d}"
    rid = plane.submit(tenant, "save_weights", lambda: tc.save_state(name, ttl, req.overwrite),
                       json_result(lambda r: tinker_types().SaveWeightsResponse(path=r.path, type="save_weights")))
    return future_response(rid, model_id=req.model_id)


async def save_weights_for_sampler(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().SaveWeightsForSamplerRequest)
    plane = plane_of(request)
    tc = plane.model(tenant, req.model_id)
    ttl = convert.ttl_seconds(request.state.json)
    t = tinker_types()
    if req.path is not None:
        rid = plane.submit(tenant, "save_weights_for_sampler",
                           lambda: tc.save_weights_for_sampler(req.path, ttl),
                           json_result(lambda r: t.SaveWeightsForSamplerResponseInternal(
                               path=r.path, type="save_weights_for_sampler")))
        return future_response(rid, model_id=req.model_id)
    if req.kind != "snapshot":
        raise BadRequest(f"kind: {req.kind!r} sampling clients are not supported (snapshot only)")
    # No name: an ephemeral snapshot of the weights after every queued call, served as a sampling session.
    rid = plane.submit(tenant, "save_weights_for_sampler", tc.snapshot_sampling_client,
                       json_result(lambda sc: t.SaveWeightsForSamplerResponseInternal(
                           sampling_session_id=plane.add_sampler(tenant, session_of(req.model_id), sc, None),
                           type="save_weights_for_sampler")))
    return future_response(rid, model_id=req.model_id)


async def save_weights_external(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().SaveWeightsExternalRequest)
    if req.age_encryption_recipients:
        raise BadRequest("age_encryption_recipients: not supported by this server (files are served unencrypted "
                         "over signed URLs; leave it unset)")
    plane = plane_of(request)
    tc = plane.model(tenant, req.model_id)
    ttl = convert.ttl_seconds(request.state.json)
    rid = plane.submit(tenant, "save_weights_external", lambda: tc.save_weights_external(req.path, ttl),
                       json_result(lambda r: tinker_types().SaveWeightsExternalResponseInternal(
                           path=r.path, type="save_weights_external")))
    return future_response(rid, model_id=req.model_id)


async def load_weights(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().LoadWeightsRequest)
    plane = plane_of(request)
    t = tinker_types()
    encode = json_result(lambda r: t.LoadWeightsResponse(path=r[0], model_id=r[1], type="load_weights"))
    if req.model_id is None:  # create_training_client_from_state*: a new run loaded in one request
        if req.session_id is None or req.model_seq_id is None:
            raise BadRequest("model_id: give model_id, or session_id and model_seq_id for a new run")
        plane.require_readable(tenant, req.path)
        rid = plane.submit(tenant, "load_weights",
                           lambda: plane.create_model_from_state(tenant, req.session_id, req.model_seq_id,
                                                                 req.path, req.optimizer, req.user_metadata),
                           encode)
        return future_response(rid, model_id=f"{req.session_id}:train:{req.model_seq_id}")
    tc = plane.model(tenant, req.model_id)
    plane.require_readable(tenant, req.path)
    load = tc.load_state_with_optimizer if req.optimizer else tc.load_state
    rid = plane.submit(tenant, "load_weights", lambda: load(req.path),
                       lambda r, proto: t.LoadWeightsResponse(path=r.path, model_id=req.model_id,
                                                              type="load_weights").model_dump(mode="json"))
    return future_response(rid, model_id=req.model_id)


ROUTES = [
    Route("/api/v1/create_model", guarded(create_model), methods=["POST"]),
    Route("/api/v1/get_info", guarded(get_info), methods=["POST"]),
    Route("/api/v1/forward_backward", guarded(forward_backward), methods=["POST"]),
    Route("/api/v1/forward", guarded(forward), methods=["POST"]),
    Route("/api/v1/create_custom_loss", guarded(create_custom_loss), methods=["POST"]),
    Route("/api/v1/optim_step", guarded(optim_step), methods=["POST"]),
    Route("/api/v1/save_weights", guarded(save_weights), methods=["POST"]),
    Route("/api/v1/save_weights_for_sampler", guarded(save_weights_for_sampler), methods=["POST"]),
    Route("/api/v1/save_weights_external", guarded(save_weights_external), methods=["POST"]),
    Route("/api/v1/load_weights", guarded(load_weights), methods=["POST"]),
]
