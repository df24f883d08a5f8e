"""The predictors' health on the real server: after real requests through admission's
predictor and the length probe shipped for the default model, /metrics and
/admin/stats report the same window, its counts, cap rate and MAE as the requests
themselves say, a tenant under the minimum without figures, and a predictor reload
starting the window over."""

from __future__ import annotations

import logging
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import kendalltau

from headroom.app.background import BackgroundServer
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ObservabilityConfig,
    TenantConfig,
)
from headroom.observability.predictor_health import auc
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

TOKEN = "admin-token-for-health-0123456789"
CONFIG = Config(
    cache=CacheConfig(num_blocks=256),
    admission=AdmissionConfig(tenants=tuple(TenantConfig(n) for n in ("default", "acme", "solo"))),
    observability=ObservabilityConfig(predictor_health_min_requests=2),
    admin=AdminConfig(token=TOKEN),
)
# (tenant, prompt, max_tokens, stop): the short caps end with "length", a stop string
# that any sentence holds ends the others with "stop".
REQUESTS = [
    ("acme", "The capital of France is", 2, None),
    ("acme", "Write a poem about the sea.", 4, None),
    ("acme", "Tell me about elephants.", 32, ["e"]),
    ("default", "List three colours.", 3, None),
    ("default", "What is a prime number?", 32, ["e"]),
    ("solo", "Name a planet.", 5, None),
]


def scrape(server) -> dict[tuple, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "predictor" in s.name or "flag_precision" in s.name
    }


ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def stats(server) -> dict:
    r = httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=10)
    assert r.status_code == 200
    return r.json()["predictor_health"]


def finished_lines(caplog, n: int, timeout: float = 10.0) -> list[logging.LogRecord]:
    # A request's window entry and log line are written just after its last byte; its
    # log line comes last, so once n are there, the window holds everything it will.
    deadline = time.monotonic() + timeout
    while True:
        lines = [r for r in caplog.records if r.getMessage() == "request finished"]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def as_metrics(figures: dict, tenant: str | None = None) -> dict[tuple, float]:
    """/admin/stats figures under the names and labels /metrics gives them."""
    prefix = "headroom:" if tenant is None else "headroom:tenant_"
    labels = () if tenant is None else (("tenant", tenant),)
    names = {
        "requests": "predictor_health_requests",
        "cap_rate": "predictor_cap_rate",
        "kendall_tau": "predictor_kendall_tau",
        "mae_tokens": "predictor_mae_tokens",
        "flag_precision": "probe_flag_precision",
    }
    out = {(prefix + names[k], labels): v for k, v in figures.items() if k in names and v is not None}
    for predictor in ("admission", "probe"):
        if (value := figures[f"{predictor}_cap_auc"]) is not None:
            key = tuple(sorted((*labels, ("predictor", predictor))))
            out[(prefix + "predictor_cap_auc", key)] = value
    return out


def test_health_after_real_requests(default_model, caplog):
    caplog.set_level(logging.INFO, logger="headroom.requests")
    server = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    try:
        finish_reasons = []
        for tenant, prompt, max_tokens, stop in REQUESTS:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stop": stop}
            r = httpx.post(server.url + "/v1/completions", json=body, headers={"X-Tenant": tenant}, timeout=120)
            assert r.status_code == 200
            finish_reasons.append(r.json()["choices"][0]["finish_reason"])
        # Only max_tokens could end this one: it says nothing about either predictor.
        body = {"prompt": "Count to ten.", "max_tokens": 3, "ignore_eos": True}
        assert (
            httpx.post(server.url + "/v1/completions", json=body, headers={"X-Tenant": "acme"}, timeout=120).status_code
            == 200
        )
        lines = finished_lines(caplog, len(REQUESTS) + 1)
        samples, health = scrape(server), stats(server)
        server_wide = {key: v for key, v in samples.items() if not key[0].startswith("headroom:tenant_")}
        assert server_wide[("headroom:predictor_health_requests", ())] == 6

        assert {"stop", "length"} == set(finish_reasons)  # both outcomes, so both AUCs are defined
        lines = [r for r in lines if not r.ignore_eos]
        assert len(lines) == len(REQUESTS)

        def mae(tenant: str | None) -> float:
            errors = [
                abs(r.predicted_output_tokens - r.output_tokens) for r in lines if tenant is None or r.tenant == tenant
            ]
            return sum(errors) / len(errors)

        assert server_wide[("headroom:predictor_cap_rate", ())] == pytest.approx(finish_reasons.count("length") / 6)
        assert server_wide[("headroom:predictor_mae_tokens", ())] == pytest.approx(mae(None))
        assert {key for key in server_wide if key[0] == "headroom:predictor_cap_auc"} == {
            ("headroom:predictor_cap_auc", (("predictor", "admission"),)),
            ("headroom:predictor_cap_auc", (("predictor", "probe"),)),
        }
        # Each figure is what the finished requests' own log lines give: a figure wired to
        # the wrong number (the p90 for the p50, the probe's for admission's) differs.
        ran_to_cap = np.array([r.finish_reason == "length" for r in lines])
        predicted = np.array([r.predicted_output_tokens for r in lines])
        share = predicted / np.array([r.max_tokens for r in lines], dtype=np.float64)
        probed = np.array([r.runaway_probability for r in lines], dtype=np.float64)
        assert server_wide[("headroom:predictor_cap_auc", (("predictor", "admission"),))] == pytest.approx(
            auc(share, ran_to_cap)
        )
        assert server_wide[("headroom:predictor_cap_auc", (("predictor", "probe"),))] == pytest.approx(
            auc(probed, ran_to_cap)
        )
        expected_tau = kendalltau(predicted, [r.output_tokens for r in lines], variant="b").statistic
        assert server_wide[("headroom:predictor_kendall_tau", ())] == pytest.approx(expected_tau)
        assert server_wide == pytest.approx(as_metrics(health["server"]))
        assert (health["window"], health["min_requests"]) == (500, 2)

        def tenant_samples(tenant: str) -> dict[tuple, float]:
            return {key: v for key, v in samples.items() if ("tenant", tenant) in key[1]}

        assert set(health["tenants"]) == {"acme", "default", "solo"}
        for tenant, count in (("acme", 3), ("default", 2)):
            own = tenant_samples(tenant)
            label = (("tenant", tenant),)
            assert own[("headroom:tenant_predictor_health_requests", label)] == count
            assert own[("headroom:tenant_predictor_mae_tokens", label)] == pytest.approx(mae(tenant))
            assert own == pytest.approx(as_metrics(health["tenants"][tenant], tenant))
        # One request is under the minimum of two: counted, and nothing else.
        assert tenant_samples("solo") == {("headroom:tenant_predictor_health_requests", (("tenant", "solo"),)): 1}
        assert health["tenants"]["solo"] == {
            "requests": 1,
            "cap_rate": None,
            "kendall_tau": None,
            "mae_tokens": None,
            "admission_cap_auc": None,
            "probe_cap_auc": None,
            "flag_precision": None,
        }

        # A reloaded predictor is a new model: its window starts empty.
        r = httpx.post(server.url + "/admin/predictor/reload", headers=ADMIN, timeout=60)
        assert r.status_code == 200
        assert stats(server)["server"]["requests"] == 0
        assert scrape(server) == {("headroom:predictor_health_requests", ()): 0}
    finally:
        server.stop()
