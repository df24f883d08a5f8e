"""The usage ledger alone: sums per tenant and outcome over a time range, retention, and
what survives closing and reopening the file."""

from __future__ import annotations

import dataclasses
import sqlite3

from headroom.contracts.request import AdmissionRecord, Request, RequestStatus, Resources, SamplingParams
from headroom.observability.finished import FinishedRequest
from headroom.observability.ledger import Usage, UsageLedger


def ran(tenant: str, status: RequestStatus, prompt: int, output: int, **cost) -> Usage:
    """The Usage of an engine request that ended with `status`."""
    request = Request(
        "r",
        list(range(1, prompt + 1)),
        SamplingParams(max_tokens=100),
        arrival_time=10.0,
        admission=AdmissionRecord(tenant),
        resources=Resources(
            device_time_s=cost.pop("device_time_s", 0.0), kv_block_seconds=cost.pop("kv_block_seconds", 0.0)
        ),
        status=status,
        **cost,
    )
    request.output_token_ids.extend([5] * output)
    return Usage.of_request(request)


def refused(tenant: str, **fields) -> Usage:
    done = FinishedRequest(
        request_id="r",
        endpoint="/v1/completions",
        model="m",
        http_status=429,
        tenant=tenant,
        tier="standard",
        size_class="short",
        ran=False,
        **fields,
    )
    return Usage.of_refused(done, "rejected")


def test_sums_by_tenant_and_outcome_within_the_range_and_across_a_reopen(tmp_path):
    now = [1000.0]
    ledger = UsageLedger(tmp_path / "u.sqlite", retention_days=1, clock=lambda: now[0])
    ledger.record(
        ran(
            "a",
            RequestStatus.FINISHED_STOPPED,
            10,
            5,
            num_cached_tokens=4,
            device_time_s=0.5,
            kv_block_seconds=2.0,
            admitted_time=10.25,
        )
    )
    now[0] = 1010.0
    ledger.record(ran("a", RequestStatus.FINISHED_ABORTED, 7, 3, device_time_s=0.25, admitted_time=10.0))
    ledger.record(refused("b", prompt_tokens=99, output_tokens=99, admission_wait_s=0.5))
    ledger.close()
    reopened = UsageLedger(tmp_path / "u.sqlite", retention_days=1, clock=lambda: now[0])
    a, b = reopened.usage(0, 2000)
    assert (a.tenant, a.requests["stop"], a.requests["abort"], a.requests["rejected"]) == ("a", 1, 1, 0)
    assert (a.prompt_tokens, a.cached_prompt_tokens, a.output_tokens) == (17, 4, 8)
    assert (a.device_seconds, a.kv_block_seconds, a.admission_wait_seconds) == (0.75, 2.0, 0.25)
    # A refused request is counted, and its tokens are not: it never ran.
    assert (b.tenant, b.requests["rejected"], b.prompt_tokens, b.admission_wait_seconds) == ("b", 1, 0, 0.5)
    [early] = reopened.usage(0, 1005)
    assert (early.tenant, early.requests["stop"], early.prompt_tokens) == ("a", 1, 10)
    reopened.close()


def test_rows_past_the_retention_are_deleted(tmp_path):
    now = [0.0]
    ledger = UsageLedger(tmp_path / "u.sqlite", retention_days=1, clock=lambda: now[0])
    ledger.record(ran("a", RequestStatus.FINISHED_LENGTH, 3, 1))
    now[0] = 86400 + 1
    ledger.record(ran("a", RequestStatus.FINISHED_LENGTH, 3, 2))
    assert ledger.prune() == 1
    [a] = ledger.usage(0, 10**6)
    assert (a.requests["length"], a.output_tokens) == (1, 2)
    ledger.close()
    # No text columns beyond ids, tenant, outcome and the adapter's name.
    with sqlite3.connect(tmp_path / "u.sqlite") as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(requests)")]
    assert columns == [
        "finished_at",
        "request_id",
        "tenant",
        "outcome",
        "prompt_tokens",
        "cached_prompt_tokens",
        "output_tokens",
        "device_seconds",
        "kv_block_seconds",
        "admission_wait_seconds",
        "lora",
    ]


def test_a_ledger_from_before_adapters_gains_their_column_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # the schema as it was before LoRA adapters
        db.execute(
            "CREATE TABLE requests (finished_at REAL NOT NULL, request_id TEXT NOT NULL, tenant TEXT NOT NULL, "
            "outcome TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, cached_prompt_tokens INTEGER NOT NULL, "
            "output_tokens INTEGER NOT NULL, device_seconds REAL NOT NULL, kv_block_seconds REAL NOT NULL, "
            "admission_wait_seconds REAL NOT NULL)"
        )
        db.execute("INSERT INTO requests VALUES (5, 'old', 'a', 'stop', 4, 0, 2, 0.1, 0.0, 0.0)")
    ledger = UsageLedger(path, retention_days=10**6, clock=lambda: 10.0)
    ledger.record(dataclasses.replace(ran("a", RequestStatus.FINISHED_STOPPED, 3, 1), lora="x"))
    [a] = ledger.usage(0, 100)
    assert (a.requests["stop"], a.output_tokens, a.loras) == (
        2,
        3,
        {
            "x": {
                "requests": 1,
                "prompt_tokens": 3,
                "cached_prompt_tokens": 0,
                "output_tokens": 1,
                "device_seconds": 0.0,
                "kv_block_seconds": 0.0,
                "admission_wait_seconds": a.loras["x"]["admission_wait_seconds"],
            }
        },
    )
    ledger.close()
