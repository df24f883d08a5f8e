"""The usage ledger: one row per finished request in a SQLite file, for billing
(`GET /admin/usage`). Only counts and times, never prompt or output text. It survives a
restart; rows older than the retention are deleted as new ones come in. Its totals are
the per-tenant counters of /metrics (the same FinishedRequest feeds both), summed over
whatever span of time a bill covers."""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from headroom.contracts.request import Request
from headroom.observability.finished import FinishedRequest

OUTCOMES = ("stop", "length", "repetition", "abort", "rejected", "invalid", "routed", "error")
SUMS = (
    "prompt_tokens",
    "cached_prompt_tokens",
    "output_tokens",
    "device_seconds",
    "kv_block_seconds",
    "admission_wait_seconds",
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    finished_at REAL NOT NULL,            -- unix seconds
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    outcome TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_prompt_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    device_seconds REAL NOT NULL,
    kv_block_seconds REAL NOT NULL,
    admission_wait_seconds REAL NOT NULL,
    lora TEXT                             -- the LoRA adapter; NULL: the base model
);
CREATE INDEX IF NOT EXISTS requests_by_time ON requests (finished_at);
"""
PRUNE_EVERY = 1000  # rows between deletions of expired ones


@dataclass(frozen=True)
class Usage:
    """What one finished request cost, charged to its tenant."""

    request_id: str
    tenant: str
    outcome: str  # one of OUTCOMES
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    device_seconds: float = 0.0
    kv_block_seconds: float = 0.0
    admission_wait_seconds: float = 0.0
    lora: str | None = None  # the LoRA adapter it ran under (None: the base model)

    @classmethod
    def of_request(cls, request: Request) -> Usage:
        """A request the engine ran, once the engine is done with it (a client that left
        early is charged for the step that aborted it too)."""
        admitted = request.admitted_time
        return cls(
            request.request_id,
            request.tenant or "none",
            request.status.finish_reason or "error",
            request.num_prompt_tokens,
            request.num_cached_tokens,
            request.num_output_tokens,
            request.resources.device_time_s,
            request.resources.kv_block_seconds,
            0.0 if admitted is None else admitted - request.arrival_time,
            request.lora.name if request.lora is not None else None,
        )

    @classmethod
    def of_refused(cls, done: FinishedRequest, outcome: str) -> Usage:
        """A request that never reached the engine: counted, with its wait, and no tokens."""
        return cls(done.request_id, done.tenant or "none", outcome, admission_wait_seconds=done.admission_wait_s or 0.0)


@dataclass
class TenantUsage:
    tenant: str
    requests: dict[str, int]  # by outcome
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    device_seconds: float = 0.0
    kv_block_seconds: float = 0.0
    admission_wait_seconds: float = 0.0
    # Per LoRA adapter its requests ran under: "requests" and the sums above.
    loras: dict[str, dict[str, float]] = field(default_factory=dict)


class UsageLedger:
    def __init__(self, path: str | Path, retention_days: float, clock=time.time):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.retention_s = retention_days * 86400
        self.clock = clock
        # Written from the event loop, read by the admin API, closed at shutdown: one
        # connection behind a lock, whatever thread that is.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable at checkpoints, not per row
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(requests)")}
        if "lora" not in columns:  # a ledger written before adapters existed
            self._db.execute("ALTER TABLE requests ADD COLUMN lora TEXT")
        self._lock = threading.Lock()
        self._since_prune = 0
        self.prune()

    def record(self, usage: Usage) -> None:
        row = (
            self.clock(),
            usage.request_id,
            usage.tenant,
            usage.outcome,
            *(getattr(usage, s) for s in SUMS),
            usage.lora,
        )
        names = ", ".join(("finished_at", "request_id", "tenant", "outcome", *SUMS, "lora"))
        with self._lock:
            self._db.execute(f"INSERT INTO requests ({names}) VALUES ({', '.join('?' * len(row))})", row)
            self._since_prune += 1
        if self._since_prune >= PRUNE_EVERY:
            self.prune()

    def prune(self) -> int:
        """Delete rows past the retention; returns how many."""
        with self._lock:
            self._since_prune = 0
            return self._db.execute(
                "DELETE FROM requests WHERE finished_at < ?", (self.clock() - self.retention_s,)
            ).rowcount

    def usage(self, since: float, until: float) -> list[TenantUsage]:
        """Per-tenant totals of the requests that finished in [since, until)."""
        sums = ", ".join(f"SUM({c})" for c in SUMS)
        with self._lock:
            rows = self._db.execute(
                f"SELECT tenant, outcome, COUNT(*), {sums} FROM requests "
                "WHERE finished_at >= ? AND finished_at < ? GROUP BY tenant, outcome ORDER BY tenant, outcome",
                (since, until),
            ).fetchall()
            by_lora = self._db.execute(
                f"SELECT tenant, lora, COUNT(*), {sums} FROM requests WHERE finished_at >= ? AND finished_at < ? "
                "AND lora IS NOT NULL GROUP BY tenant, lora ORDER BY tenant, lora",
                (since, until),
            ).fetchall()
        by_tenant: dict[str, TenantUsage] = {}
        for tenant, outcome, count, *totals in rows:
            usage = by_tenant.setdefault(tenant, TenantUsage(tenant, dict.fromkeys(OUTCOMES, 0)))
            usage.requests[outcome] = usage.requests.get(outcome, 0) + count
            for name, total in zip(SUMS, totals, strict=True):
                setattr(usage, name, getattr(usage, name) + total)
        for tenant, lora, count, *totals in by_lora:
            by_tenant[tenant].loras[lora] = {"requests": count, **dict(zip(SUMS, totals, strict=True))}
        return list(by_tenant.values())

    def close(self) -> None:
        with self._lock:
            self._db.close()
