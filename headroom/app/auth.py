"""Who may call which route, checked before any handler runs.

With [admission] auth on, every route but /health needs a key: /v1/* and /openapi.json a
tenant's API key, /metrics the metrics token or the admin token (its labels name every
tenant, so a tenant's key is refused there), /admin/* the admin token (the admin
sub-app's own middleware, which also serves its static /admin/ui page: that page shows
nothing until the operator gives it the token). With auth off, /metrics needs a token
only where one is set. vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter take the admin token, auth on or
off. SECURITY.md lists the routes and who may call each."""

from __future__ import annotations

import hashlib
import hmac
import os

from aiohttp import web

from headroom.app import keys
from headroom.app.errors import Forbidden, Unauthorized
from headroom.config import Config

METRICS_TOKEN_ENV = "HEADROOM_METRICS_TOKEN"
OPEN_PATHS = frozenset({"/health"})
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def metrics_token(config: Config) -> str | None:
    return config.observability.metrics_token or os.environ.get(METRICS_TOKEN_ENV) or None


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    return (header.removeprefix("Bearer ").strip() or None) if header.startswith("Bearer ") else None


def digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def guard(config: Config, admin_token: str | None) -> web.middleware:
    """The middleware that enforces the rules above for this config."""
    auth = config.admission.auth
    scraper_token = metrics_token(config)
    scrapers = tuple(digest(t) for t in (scraper_token, admin_token) if t is not None)
    admin_digest = digest(admin_token) if admin_token is not None else None
    metrics_guarded = auth or scraper_token is not None

    def scraper(given: str) -> bool:
        # Every digest compared, in constant time: timing says nothing about which matched.
        return sum(hmac.compare_digest(digest(given), d) for d in scrapers) > 0

    @web.middleware
    async def middleware(request: web.Request, handler):
        path = request.path
        if path in OPEN_PATHS or path.startswith("/admin/"):
            return await handler(request)
        given = bearer(request)
        if path in ADMIN_PATHS:
            if not (given and admin_digest and hmac.compare_digest(digest(given), admin_digest)):
                raise Unauthorized(f"{path} needs the admin bearer token", code="invalid_admin_token")
        elif path == "/metrics":
            if metrics_guarded and not (given and scraper(given)):
                if given and request.app[keys.GATE].registry.by_api_key(given) is not None:
                    raise Forbidden("tenant API keys cannot read /metrics", code="metrics_forbidden")
                raise Unauthorized("/metrics needs the metrics or admin bearer token", code="invalid_metrics_token")
        elif auth and request.app[keys.GATE].registry.resolve(given) is None:
            raise Unauthorized("Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)

    return middleware
