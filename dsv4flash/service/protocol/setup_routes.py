"""Set-up and sessions of the Tinker protocol: health, client config, key -> JWT exchange, sessions and heartbeats,
capabilities, telemetry."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsv4flash.service.protocol.http import guarded, model_json, parse, plane_of, read_body, tenant_of, tinker_types


async def healthz(request: Request) -> Response:
    return model_json(tinker_types().HealthResponse(status="ok"))


async def client_config(request: Request) -> Response:
    tenant_of(request)
    # Key -> JWT exchange (what lets MinT's sk- keys through its patched auth); httpx transport; chunks in
    # order; zstd-compressed protobuf bodies; one retrieve_futures poller per sampling session; custom losses
    # uploaded and run here.
    return model_json(tinker_types().ClientConfigResponse(
        pjwt_auth_enabled=True, use_pyqwest_transport=False, parallel_fwdbwd_chunks=False,
        proto_compress_fwdbwd=True, sample_use_retrieve_futures=True, custom_loss_server_side=True))


async def auth_token(request: Request) -> Response:
    tenant = tenant_of(request)
    await read_body(request)
    return model_json(tinker_types().AuthTokenResponse(jwt=request.app.state.tokens.issue(tenant)))


async def client_dynamic_config(request: Request) -> Response:
    tenant_of(request)
    return model_json(tinker_types().ClientDynamicConfigResponse(sample_cancel_enabled=True))


async def create_session(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().CreateSessionRequest)
    sid = plane_of(request).create_session(tenant, req.user_metadata)
    return model_json(tinker_types().CreateSessionResponse(session_id=sid))


async def session_heartbeat(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().SessionHeartbeatRequest)
    plane_of(request).heartbeat(tenant, req.session_id)
    return model_json(tinker_types().SessionHeartbeatResponse())


async def finish_session(request: Request) -> Response:
    tenant = tenant_of(request)
    await read_body(request)
    plane_of(request).finish_session(tenant, request.path_params["session_id"])
    return JSONResponse({})


async def capabilities(request: Request) -> Response:
    tenant_of(request)
    t = tinker_types()
    plane = plane_of(request)
    # Only the served name: `tiny` (or --base's path) is still accepted as base_model, but a client that samples
    # under it would look its tokenizer up on the hub.
    return model_json(t.GetServerCapabilitiesResponse(supported_models=[t.SupportedModel(
        model_name=plane.served_base_name, max_context_length=int(plane.service.base.cfg.text.max_position_embeddings),
        trainable=True, sampleable=True)]))


async def telemetry(request: Request) -> Response:
    tenant_of(request)
    await read_body(request)  # accepted and dropped: a local server keeps no client telemetry
    return model_json(tinker_types().TelemetryResponse(status="accepted"))


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
]
