"""Getting weights out: signed, expiring download URLs on the same server, for both SDK generations.

- SDK 0.38 (`RestClient.get_external_weights_urls`, `tinker checkpoint download`): `GET …/external_weights_urls`
  answers one URL per file of the checkpoint's PEFT export (`ExternalWeightsUrlsResponse`).
- SDK 0.22 (`get_checkpoint_archive_url`, MinT's client): `GET …/archive` answers 302 with the URL of a tar of the
  same files in `Location` and its expiry in `Expires`, which is what that SDK reads.
- `GET /api/v1/downloads/{token}/{file}` serves them, without an API key: the token is the grant
  (`plane/downloads.py`), checked again at every download.

Any checkpoint the caller may read (its own, or a published one) can be fetched, whatever its kind.
"""

from __future__ import annotations

import asyncio
import email.utils
from datetime import datetime, timezone
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Route

from dsv4flash.service.plane.downloads import ARCHIVE_NAME, BadGrant, ExpiredGrant, archive_files, tar_stream
from dsv4flash.service.plane.policy_server import NotFound
from dsv4flash.service.protocol.http import HTTPError, guarded, model_json, tenant_of, tinker_types
from dsv4flash.service.protocol.rest_routes import checkpoint_of


async def _signed(request: Request):
    """(export directory, token, expiry) for the checkpoint named by the route, signed for the caller."""
    tenant = tenant_of(request)
    plane = request.app.state.plane
    path = checkpoint_of(request, tenant, readable=True).tinker_path
    directory, revision = await asyncio.to_thread(plane.service.peft_archive, path)
    token, expires = request.app.state.downloads.sign(tenant, path, revision,
                                                      not_after=plane.service.checkpoints.get(path)["expires_at"])
    return directory, token, expires


def _url(request: Request, token: str, name: str) -> str:
    return f"{str(request.base_url).rstrip('/')}/api/v1/downloads/{token}/{quote(name)}"


async def external_weights_urls(request: Request) -> Response:
    directory, token, expires = await _signed(request)
    return model_json(tinker_types().ExternalWeightsUrlsResponse(
        urls={name: _url(request, token, name) for name in archive_files(directory)},
        expires=datetime.fromtimestamp(expires, tz=timezone.utc)))


async def archive(request: Request) -> Response:
    _, token, expires = await _signed(request)
    return Response(status_code=302, headers={"Location": _url(request, token, ARCHIVE_NAME),
                                              "Expires": email.utils.formatdate(expires, usegmt=True)})


async def download(request: Request) -> Response:
    plane = request.app.state.plane
    try:
        grant = request.app.state.downloads.verify(request.path_params["token"])
    except BadGrant as exc:
        raise HTTPError(403, str(exc)) from exc
    except ExpiredGrant as exc:
        raise HTTPError(410, str(exc)) from exc
    if grant.tenant not in request.app.state.keys.tenants():
        raise HTTPError(403, "download URL: its tenant holds no key on this server any more")
    plane.require_readable(grant.tenant, grant.path)  # deleted, expired or unpublished since: 404
    if plane.service.require_checkpoint(grant.path).id != grant.revision:
        raise NotFound(f"checkpoint {grant.path} was saved again since this URL was signed (ask for a new URL)")
    directory, _ = await asyncio.to_thread(plane.service.peft_archive, grant.path)
    name = request.path_params["name"]
    if name == ARCHIVE_NAME:
        size, chunks = tar_stream(directory)
        return StreamingResponse(chunks, media_type="application/x-tar",
                                 headers={"Content-Length": str(size),
                                          "Content-Disposition": f'attachment; filename="{ARCHIVE_NAME}"'})
    if name not in archive_files(directory):
        raise NotFound(f"{name!r} is not a file of checkpoint {grant.path} (files: {archive_files(directory)})")
    return FileResponse(directory / name, media_type="application/octet-stream")


_CKPT = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"

ROUTES = [
    Route(_CKPT + "/external_weights_urls", guarded(external_weights_urls), methods=["GET"]),
    Route(_CKPT + "/archive", guarded(archive), methods=["GET"]),
    Route("/api/v1/downloads/{token}/{name}", guarded(download), methods=["GET"]),
]
