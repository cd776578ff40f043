"""HTTP plumbing shared by the routes: authentication, bounded bodies, schema validation, error answers.

Errors answer `{"detail": …, "error": …}` (the SDK shows `detail`); 400s also carry `field`, the dotted
path of the first bad field, so a malformed request says what to fix.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsv4flash.lifecycle.errors import IntegrityError, SlotQueueFull
from dsv4flash.service.plane.operations import QueueFull, UnknownOperation
from dsv4flash.service.plane.policy_server import BadRequest, Conflict, Gone, NotFound
from dsv4flash.service.protocol.wire import BodyTooLarge, WireError


class HTTPError(Exception):
    """An answer other than 200: status, message, and the field at fault (if any)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def error_response(status: int, message: str, field: str | None = None, *, retry: bool | None = None,
                   retry_after_s: float | None = None) -> JSONResponse:
    """The JSON body of an error answer; `retry=False` tells the SDK not to retry a status it otherwise would;
    `retry_after_s` sets `Retry-After` (whole seconds, rounded up)."""
    body: dict[str, Any] = {"detail": message, "error": message}
    if field is not None:
        body["field"] = field
    headers = {"x-should-retry": "true" if retry else "false"} if retry is not None else {}
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))
    return JSONResponse(body, status_code=status, headers=headers or None)


def tenant_of(request: Request) -> str:
    """The caller's tenant from `X-API-Key` (401 when absent or unknown)."""
    key = request.headers.get("x-api-key")
    if not key:
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else None
    if key and key.startswith("eyJ"):  # a JWT from /auth/token
        tenant = request.app.state.tokens.tenant(key)
    else:
        tenant = request.app.state.keys.tenant(key)
    if tenant is None:
        raise HTTPError(401, "missing or unknown API key (send it as the X-API-Key header, or as "
                             "'Authorization: Bearer <key>')")
    return tenant


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 past the server's size limit."""
    limit = request.app.state.max_body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


async def require_room(request: Request, tenant: str) -> None:
    """429 at once when the tenant's queue is full, before its body is decoded (a flood of refused requests costs
    the server a read, not a parse); the body is still read so the connection stays usable."""
    try:
        request.app.state.plane.ops.require_room(tenant)
    except QueueFull:
        await read_body(request)
        raise


async def parse(request: Request, model):
    """The JSON body validated as a `tinker.types` request model (400 naming the first bad field); the body as
    sent stays in `request.state.json`."""
    from pydantic import ValidationError

    raw = await read_body(request)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise HTTPError(400, f"body: not JSON ({exc})", "body") from exc
    if not isinstance(data, dict):
        raise HTTPError(400, f"body: expected a JSON object, got {type(data).__name__}", "body")
    request.state.json = data  # as sent: validation coerces (true -> 1, "5" -> 5), and some fields must not be
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise HTTPError(400, f"{model.__name__}.{where}: {first.get('msg')}", where) from exc


def model_json(obj, status: int = 200) -> JSONResponse:
    """A pydantic model (from `tinker.types`) as the JSON answer."""
    return JSONResponse(obj.model_dump(mode="json", exclude_none=True), status_code=status)


def answer_of(exc: BaseException) -> tuple[int, str, str | None, bool | None] | None:
    """(status, message, field at fault, retry flag) of a plane / wire / core error; None for an unexpected one.
    The one mapping of errors to statuses: the Tinker routes and the OpenAI routes answer it in their shapes."""
    if isinstance(exc, HTTPError):
        return exc.status, exc.message, exc.field, None
    if isinstance(exc, Conflict):  # the SDK retries 409 (lock timeouts); the same request conflicts every time
        return 409, str(exc), str(exc).split(":", 1)[0], False
    if isinstance(exc, BodyTooLarge):
        return 413, str(exc), None, None
    if isinstance(exc, (BadRequest, WireError)):
        msg = str(exc)
        return 400, msg, msg.split(":", 1)[0] if ":" in msg else None, None
    if isinstance(exc, (NotFound, UnknownOperation)):
        return 404, str(exc).strip("'\""), None, None
    if isinstance(exc, Gone):
        return 410, str(exc), None, None
    if isinstance(exc, IntegrityError):  # damaged stored bytes: the server's fault, and no retry repairs them
        return 500, str(exc), None, False
    if isinstance(exc, (QueueFull, SlotQueueFull)):  # the tenant's request bound, or every adapter slot's queue
        return 429, str(exc), None, None
    if isinstance(exc, PermissionError):  # e.g. a run id another tenant owns: answered as absent, naming nothing
        return 404, "not found", None, None
    if isinstance(exc, (ValueError, KeyError, FileNotFoundError)):  # bad values caught by the core at submit time
        return 400, str(exc).strip("'\""), None, None
    return None


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds a 429's `Retry-After` asks for: the slot queue's estimate, else 1 (a tenant's request finishing
    frees its bound); None for other errors."""
    if isinstance(exc, SlotQueueFull):
        return exc.retry_after_s
    return 1.0 if isinstance(exc, QueueFull) else None


def guarded(handler):
    """Wrap a route so plane/wire errors become their HTTP answers."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            answer = answer_of(exc)
            if answer is None:
                raise
            status, message, field, retry = answer
            return error_response(status, message, field, retry=retry, retry_after_s=retry_after_of(exc))

    route.__name__ = handler.__name__
    return route


def tinker_types():
    """`tinker.types` (imported on first use: the server extra's pinned SDK)."""
    from tinker import types

    return types


def plane_of(request: Request):
    """The PolicyServer behind this app."""
    return request.app.state.plane


def future_response(request_id: str, **extra) -> JSONResponse:
    """The `UntypedAPIFuture` answer of a queued request."""
    return model_json(tinker_types().UntypedAPIFuture(request_id=request_id, **extra))


def json_result(model):
    """An operation encoder: result -> `model(result)` as JSON (for results the SDK reads as JSON)."""
    return lambda result, proto: model(result).model_dump(mode="json", exclude_none=True)
