"""deploy/grafana/headroom.json and the alerting rules read only metrics that exist: every
name in a dashboard query is one /metrics really exports (scraped from a real server
after real requests) or one deploy/prometheus/rules.yml records, and every name a rule
reads is exported too."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

from headroom.app.background import BackgroundServer
from headroom.config import AdmissionConfig, CacheConfig, Config, SchedulerConfig, TenantConfig
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "headroom.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
NAME = re.compile(r"headroom:[A-Za-z0-9_:]+")


@pytest.fixture(scope="module")
def exported(default_model) -> set[str]:
    config = Config(
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4),
        admission=AdmissionConfig(tenants=(TenantConfig("default"), TenantConfig("other"))),
    )
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("headroom:")}
    # Families with no sample yet (the split ratio waits for 20 finished requests).
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE headroom:")}
    return samples | families


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def test_every_dashboard_query_names_a_real_metric(exported):
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert len(panels) == 13 and len(exprs) == 34
    names = {name for expr in exprs for name in NAME.findall(expr)}
    assert names - exported - recorded() == set()
    assert {
        "headroom:ttft_seconds:p99_5m:by_class",
        "headroom:tenant_device_seconds_total",
        "headroom:kv_cache_usage_perc",
        "headroom:pool_split_ratio",
    } <= names  # the picture, cost, pool, split
    # The predictors' health, server-wide and per tenant, beside the floors its alerts use.
    assert {
        "headroom:predictor_kendall_tau",
        "headroom:predictor_cap_auc",
        "headroom:probe_flag_precision",
        "headroom:predictor_mae_tokens",
        "headroom:tenant_predictor_kendall_tau",
        "headroom:predictor_cap_auc_floor",
    } <= names


def test_every_rule_reads_a_real_metric(exported):
    read = {name for rule in rules() for name in NAME.findall(rule["expr"])}
    assert read - exported - recorded() == set()
    # The names the rules read that the server must export (not what they record themselves).
    assert read - recorded() == {
        "headroom:time_to_first_token_seconds_bucket",
        "headroom:time_per_output_token_seconds_bucket",
        "headroom:request_queue_time_seconds_bucket",
        "headroom:tenant_device_seconds_total",
        "headroom:engine_busy_seconds_total",
        "headroom:hol_coupling",
        "headroom:kv_cache_usage_perc",
        "headroom:num_preemptions_total",
        "headroom:pool_split_ratio",
        "headroom:predictor_kendall_tau",
        "headroom:tenant_predictor_kendall_tau",
        "headroom:predictor_cap_auc",
        "headroom:tenant_predictor_cap_auc",
        "headroom:probe_flag_precision",
        "headroom:tenant_probe_flag_precision",
        "headroom:predictor_cap_rate",
        "headroom:tenant_predictor_cap_rate",
    }


def test_a_misspelt_name_would_be_caught(exported):
    assert "headroom:kv_cache_usage_percent" not in exported | recorded()
