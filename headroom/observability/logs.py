"""Logging: the code logs through the standard library; structlog renders every record,
as JSON lines (the default) or for a human when stderr is a terminal. Fields bound
with structlog.contextvars (the request id, bound by the request middleware) and a
record's `extra` fields land in the line."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TextIO

import structlog

from headroom.observability.finished import FinishedRequest

request_log = logging.getLogger("headroom.requests")


def configure_logging(log_format: str = "auto", level: str = "INFO", stream: TextIO | None = None) -> None:
    stream = stream if stream is not None else sys.stderr
    as_json = log_format == "json" or (log_format == "auto" and not stream.isatty())
    pre_chain = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def log_finished(done: FinishedRequest, trace_id: str | None, prompt: list[dict] | None = None) -> None:
    """One line per finished request. `prompt` is only given when prompt logging is on."""
    fields = {k: v for k, v in dataclasses.asdict(done).items() if v is not None and k != "first_token_at"}
    fields["trace_id"] = trace_id
    if prompt is not None:
        fields["prompt"] = prompt
    level = logging.WARNING if done.http_status >= 500 else logging.INFO
    request_log.log(level, "request finished", extra=fields)
