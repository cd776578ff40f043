"""Futures of the Tinker protocol: retrieve_future (long poll; result, try_again / 408 with queue state, 410,
or a failed request's error), retrieve_futures (a sampling session's completion queue, long-polled by the
SDK's session poller) and cancel_future."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dsv4flash.service.protocol import convert, wire
from dsv4flash.service.protocol.http import (error_response, guarded, model_json, parse, plane_of, tenant_of,
                                             tinker_types)


async def retrieve_future(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().FutureRetrieveRequest)
    plane = plane_of(request)
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


async def retrieve_futures(request: Request) -> Response:
    tenant = tenant_of(request)
    t = tinker_types()
    req = await parse(request, t.FuturesRetrieveRequest)
    plane = plane_of(request)
    queue = plane.sampler(tenant, req.target.sampling_session_id).completion_queue(req.target.cloned_sampler_id)
    for rid in req.retrieved_request_ids:  # fetched by the client: their payloads may go
        plane.ops.forget(rid, tenant)
    completions, cursor = queue.poll(req.prev_cursor)
    timeout = request.app.state.poll_s if req.timeout is None else min(float(req.timeout), request.app.state.poll_s)
    if not completions and timeout > 0:
        await queue.wait(req.prev_cursor, timeout)
        completions, cursor = queue.poll(req.prev_cursor)
    return model_json(t.FuturesRetrieveResponse(cursor=cursor, completions=[
        t.FutureFailed(request_id=rid) if failed else t.FutureFinished(request_id=rid)
        for rid, failed in completions]))


async def cancel_future(request: Request) -> Response:
    tenant = tenant_of(request)
    req = await parse(request, tinker_types().FutureRetrieveRequest)
    try:
        plane_of(request).ops.cancel(req.request_id, tenant)
    except KeyError:
        pass  # cancelling what is already gone is a no-op
    return JSONResponse({})


ROUTES = [
    Route("/api/v1/retrieve_future", guarded(retrieve_future), methods=["POST"]),
    Route("/api/v1/retrieve_futures", guarded(retrieve_futures), methods=["POST"]),
    Route("/api/v1/cancel_future", guarded(cancel_future), methods=["POST"]),
]
