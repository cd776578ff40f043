"""HTTP plumbing shared by the routes: authentication, bounded bodies, schema validation, error answers.

Errors answer `{"detail": …, "error": …}` (the SDK shows `detail`); 400s also carry `field`, the dotted
path of the first bad field, so a malformed request says what to fix.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsv4flash.service.plane.operations import QueueFull, UnknownOperation
from dsv4flash.service.plane.policy_server import BadRequest, Gone, NotFound
from dsv4flash.service.protocol.wire import WireError


class HTTPError(Exception):
    """An answer other than 200: status, message, and the field at fault (if any)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def error_response(status: int, message: str, field: str | None = None) -> JSONResponse:
    """The JSON body of an error answer."""
    body: dict[str, Any] = {"detail": message, "error": message}
    if field is not None:
        body["field"] = field
    return JSONResponse(body, status_code=status)


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
        raise HTTPError(401, "missing or unknown API key (send it as the X-API-Key header)")
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


async def parse(request: Request, model):
    """The JSON body validated as a `tinker.types` request model (400 naming the first bad field)."""
    from pydantic import ValidationError

    raw = await read_body(request)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise HTTPError(400, f"body: not JSON ({exc})", "body") from exc
    if not isinstance(data, dict):
        raise HTTPError(400, f"body: expected a JSON object, got {type(data).__name__}", "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise HTTPError(400, f"{model.__name__}.{where}: {first.get('msg')}", where) from exc


def model_json(obj, status: int = 200) -> JSONResponse:
    """A pydantic model (from `tinker.types`) as the JSON answer."""
    return JSONResponse(obj.model_dump(mode="json", exclude_none=True), status_code=status)


def guarded(handler):
    """Wrap a route so plane/wire errors become their HTTP answers."""

    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as exc:
            return error_response(exc.status, exc.message, exc.field)
        except (BadRequest, WireError) as exc:
            msg = str(exc)
            return error_response(400, msg, msg.split(":", 1)[0] if ":" in msg else None)
        except (NotFound, UnknownOperation) as exc:
            return error_response(404, str(exc).strip("'\""))
        except Gone as exc:
            return error_response(410, str(exc))
        except QueueFull as exc:
            return error_response(429, str(exc))
        except PermissionError:  # e.g. a run id another tenant owns: answered as absent, naming nothing
            return error_response(404, "not found")
        except (ValueError, KeyError, FileNotFoundError) as exc:  # bad values caught by the core at submit time
            return error_response(400, str(exc).strip("'\""))

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
