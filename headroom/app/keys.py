"""Typed keys for what the aiohttp application holds (no module-level singletons)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from headroom.app.admission_gate import AdmissionGate
from headroom.app.engine_client import AsyncEngine
from headroom.config import Config
from headroom.observability.observer import Observability, RequestTrace

CONFIG = web.AppKey("config", Config)
ENGINE = web.AppKey("engine", AsyncEngine)
GATE = web.AppKey("gate", AdmissionGate)
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)  # for proxying to other pools
OPENAPI = web.AppKey("openapi", dict)
OBSERVABILITY = web.AppKey("observability", Observability)
TRACE = web.RequestKey("trace", RequestTrace)  # per request, set by observe_middleware


@dataclass
class Lifecycle:
    started_at: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: /health and new requests answer 503


LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
