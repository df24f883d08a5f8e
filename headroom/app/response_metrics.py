"""The `metrics` object of a response (vLLM's --enable-per-request-metrics, in headroom's
own words and units): what the request waited for and cost, for a client's billing and
objectives. It is RequestMetrics, the very numbers of the request's span and log line,
on the final response body or on the last event of a stream."""

from __future__ import annotations

import time
from dataclasses import asdict

from headroom.admission.tenants import Tenant
from headroom.config import ServerConfig
from headroom.contracts.request import Request
from headroom.observability.request_metrics import RequestMetrics


def reports_metrics(server: ServerConfig, tenant: Tenant) -> bool:
    """Does this tenant's response carry a `metrics` object? Its own setting, else the server's."""
    own = tenant.config.request_metrics
    return server.request_metrics if own is None else own


def metrics_of(engine_requests: list[Request]) -> dict | None:
    """The `metrics` object of a finished request; None (null) for n choices, which are n
    sequences with timings of their own (as vLLM: no one set of numbers is the request's)."""
    if len(engine_requests) != 1:
        return None
    request = engine_requests[0]
    # The HTTP handler's arrival is the request's (openai_api.build_request), as on its span.
    return asdict(RequestMetrics.of(request, request.arrival_time, time.monotonic()))
