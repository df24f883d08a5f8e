"""Schemathesis against the server's own /openapi.json (public and admin API): bounded
examples per operation; never a 5xx, every error in OpenAI's shape, healthy and
holding nothing after."""

from __future__ import annotations

import itertools

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    SchedulerConfig,
    TenantConfig,
)
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

TOKEN = "fuzz-admin-token-0123456789"
# Every generated request is cut to 4 output tokens, so valid ones cost milliseconds.
CONFIG = Config(
    cache=CacheConfig(num_blocks=512),
    scheduler=SchedulerConfig(max_num_seqs=16),
    admission=AdmissionConfig(
        tenants=(
            TenantConfig(
                "default", max_tokens=4, max_in_flight_tokens=10**6, rate_tokens_per_s=1e6, burst_tokens=10**6
            ),
        )
    ),
    admin=AdminConfig(token=TOKEN),
)


@pytest.fixture(scope="module")
def fuzz_server(default_model):
    server = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    spec = httpx.get(fuzz_server.url + "/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(spec)


def check(case, response) -> None:
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, response.text
        assert set(body["error"]) == {"message", "type", "param", "code"}, response.text
        assert isinstance(body["error"]["message"], str)


def fuzzer(operation, mode: GenerationMode, url: str, headers: dict, calls: dict, label: str):
    # Positive cases follow the schema; negative ones break it on purpose.
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        calls[label] = calls.get(label, 0) + 1
        check(case, case.call(base_url=url, headers=headers, timeout=60))

    return fuzz


def test_no_5xx_and_errors_are_openai_shaped(api_schema, fuzz_server):
    # Hypothesis driven directly over each operation's strategy (schemathesis's pytest
    # plugin is not used: it does not work with this pytest).
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 16
    headers = {"Authorization": f"Bearer {TOKEN}"}
    calls: dict[str, int] = {}
    for operation, mode in itertools.product(operations, GenerationMode):
        label = f"{operation.label} {mode.value}"
        try:
            fuzzer(operation, mode, fuzz_server.url, headers, calls, label)()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE  # nothing to break in an operation without inputs
    print({label: n for label, n in sorted(calls.items())})
    assert len({label.rsplit(" ", 1)[0] for label in calls}) == 16 and sum(calls.values()) >= 16 * 2 * 5
    # Some generated requests were valid enough to run on the model.
    assert fuzz_server.engine.counters().requests_started > 0
    # Healthy and leak-free after exactly this fuzzing (checked here, not in a later test
    # that would see an idle server when run alone).
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    wait_idle(fuzz_server.engine, timeout=30)
    fuzz_server.engine.block_manager.check_invariants()
    gate = fuzz_server.app[keys.GATE]
    assert all(t.bucket.in_flight == 0 for t in gate.registry)
    assert fuzz_server.app[keys.ENGINE].submitted == {}
