"""The ASGI application of `dsv4flash serve` (Starlette): the Tinker routes over one `PolicyServer`."""

from __future__ import annotations

from contextlib import asynccontextmanager

from starlette.applications import Starlette

from dsv4flash.service.plane.keys import KeyRing
from dsv4flash.service.plane.policy_server import PolicyServer


def build_app(plane: PolicyServer, keys: KeyRing, *, max_body: int = 64 << 20, poll_s: float = 5.0) -> Starlette:
    """Starlette app serving `plane` to the holders of `keys` (bodies ≤ `max_body` bytes; long polls ≤ `poll_s`);
    the JWT signing secret lives in the store (`<store>/service/jwt_secret`)."""
    from dsv4flash.service.plane.keys import TokenSigner

    from dsv4flash.service.protocol import (future_routes, mint_routes, rest_routes, sampling_routes, setup_routes,
                                            training_routes)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        plane.close()

    app = Starlette(routes=[*setup_routes.ROUTES, *training_routes.ROUTES, *sampling_routes.ROUTES,
                            *future_routes.ROUTES, *rest_routes.ROUTES, *mint_routes.ROUTES], lifespan=lifespan)
    app.state.plane, app.state.keys = plane, keys
    app.state.tokens = TokenSigner(plane.service.root / "service" / "jwt_secret")
    app.state.max_body, app.state.poll_s = int(max_body), float(poll_s)
    return app
