"""The ASGI application of `dsv4flash serve` (Starlette): the Tinker routes, the OpenAI routes and the serving
routes (metrics, prewarm) over one `PolicyServer`."""

from __future__ import annotations

from contextlib import asynccontextmanager

from starlette.applications import Starlette

from dsv4flash.service.plane.downloads import DownloadSigner
from dsv4flash.service.plane.keys import KeyRing, TokenSigner
from dsv4flash.service.plane.policy_server import PolicyServer


def build_app(plane: PolicyServer, keys: KeyRing, tokens: TokenSigner, downloads: DownloadSigner, *,
              max_body: int = 64 << 20, poll_s: float = 5.0) -> Starlette:
    """Starlette app serving `plane` to the holders of `keys` and of JWTs `tokens` signed, with download URLs
    `downloads` signs (bodies ≤ `max_body` bytes; long polls ≤ `poll_s`)."""
    from dsv4flash.service.protocol import (download_routes, future_routes, mint_routes, openai_routes, rest_routes,
                                            sampling_routes, serving_routes, setup_routes, training_routes)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        plane.close()
        if plane.service.serving is not None:
            plane.service.serving.close()

    app = Starlette(routes=[*setup_routes.ROUTES, *training_routes.ROUTES, *sampling_routes.ROUTES,
                            *future_routes.ROUTES, *rest_routes.ROUTES, *download_routes.ROUTES, *mint_routes.ROUTES,
                            *openai_routes.ROUTES, *serving_routes.ROUTES],
                  lifespan=lifespan)
    app.state.plane, app.state.keys = plane, keys
    app.state.tokens, app.state.downloads = tokens, downloads
    app.state.max_body, app.state.poll_s = int(max_body), float(poll_s)
    return app
