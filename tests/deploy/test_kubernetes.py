"""deploy/kubernetes renders, per pool, into objects that fit the server they run: probes
on /health at the port headroom.toml serves, a grace period that outlasts the SIGTERM
drain, secrets only through secretKeyRef under the names the server reads, scrape
annotations on /metrics, an HPA on the adapter's name for the queue gauge, the
interactive pool's proxy aimed at the long pool's Service, an InferencePool whose EPP
reads metrics a real server exports as gauges."""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml
from aiohttp.web_runner import BaseRunner

from headroom.admin.api import TOKEN_ENV
from headroom.app import keys
from headroom.app.admission_gate import STORE_ENV
from headroom.app.cli import build_config
from headroom.config import Config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
ADAPTER = K8S / "prometheus-adapter" / "values.yaml"
SECRET = K8S / "secret.example.yaml"
POOLS = ("interactive", "long")
KUBECTL = shutil.which("kubectl")
# How long aiohttp's runner waits at shutdown for handlers still running after drain(),
# which counts engine requests only, not the streams proxied to the long pool.
AIOHTTP_SHUTDOWN_S = inspect.signature(BaseRunner.__init__).parameters["shutdown_timeout"].default
NAME = re.compile(r"headroom:[A-Za-z0-9_:]+")
EPP_SPECS = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")
# The v1.4+ EPP exits when these are given; the names belong in its EndpointPickerConfig.
REFUSED_EPP_FLAGS = (
    "--total-queued-requests-metric",
    "--total-running-requests-metric",
    "--kv-cache-usage-percentage-metric",
)

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (it renders the kustomizations)")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    out = {}
    for pool in POOLS:
        run = subprocess.run(
            [KUBECTL, "kustomize", str(K8S / "overlays" / pool)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert run.returncode == 0, run.stderr
        out[pool] = [doc for doc in yaml.safe_load_all(run.stdout) if doc]
    return out


def find(objs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    """Objects of a kind; for workloads and Services, only the given component's."""
    found = [o for o in objs if o["kind"] == kind]
    if component is not None:
        found = [o for o in found if _component(o) == component]
    return found


def one(objs: list[dict], kind: str, component: str | None = None) -> dict:
    found = find(objs, kind, component)
    assert len(found) == 1, f"{len(found)} {kind} objects ({component or 'any'})"
    return found[0]


def _component(obj: dict) -> str | None:
    spec = obj.get("spec", {})
    labels = spec.get("template", {}).get("metadata", {}).get("labels") or spec.get("selector") or {}
    return labels.get("app.kubernetes.io/component")


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def port_number(c: dict, port: int | str) -> int:
    """A probe's or Service's port, named or numbered, as the container port it reaches."""
    if isinstance(port, int):
        assert port in {p["containerPort"] for p in c["ports"]}, f"port {port} is not a container port"
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    return number


def mounted_configmap(objs: list[dict], deployment: dict, mount_path: str, c: dict) -> dict:
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    (cm,) = [o for o in find(objs, "ConfigMap") if o["metadata"]["name"] == volume["configMap"]["name"]]
    return cm


def server(objs: list[dict]) -> tuple[dict, dict]:
    deployment = one(objs, "Deployment", "server")
    return deployment, container(deployment, "headroom")


def server_config(objs: list[dict], tmp_path: Path) -> Config:
    """The pool's headroom.toml, mounted where `serve --config` reads it, built as the CLI would."""
    deployment, c = server(objs)
    args = c["args"]
    assert args[0] == "serve" and "--config" in args
    path = Path(args[args.index("--config") + 1])
    cm = mounted_configmap(objs, deployment, str(path.parent), c)
    local = tmp_path / path.name
    local.write_text(cm["data"][path.name], encoding="utf-8")
    return build_config(argparse.Namespace(config=str(local)))


def epp_args(objs: list[dict]) -> list[str]:
    return container(one(objs, "Deployment", "epp"), "epp")["args"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def epp_config(objs: list[dict]) -> tuple[str, dict]:
    deployment = one(objs, "Deployment", "epp")
    c = container(deployment, "epp")
    path = Path(flag(c["args"], "--config-file"))
    text = mounted_configmap(objs, deployment, str(path.parent), c)["data"][path.name]
    return text, yaml.safe_load(text)


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    return rule


@pytest.mark.parametrize("pool", POOLS)
def test_probes_ask_health_on_the_port_the_server_listens_on(rendered, pool, tmp_path):
    objs = rendered[pool]
    config = server_config(objs, tmp_path)
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8000)  # 127.0.0.1 fails every probe
    _, c = server(objs)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert port_number(c, get["port"]) == config.server.port, probe
    service = one(objs, "Service", "server")
    (port,) = service["spec"]["ports"]
    assert port_number(c, port["targetPort"]) == config.server.port


@pytest.mark.parametrize("pool", POOLS)
def test_the_grace_period_outlasts_prestop_and_the_drain(rendered, pool, tmp_path):
    objs = rendered[pool]
    config = server_config(objs, tmp_path)
    deployment, c = server(objs)
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep_s = int(command[1])
    assert sleep_s >= 5  # long enough for the endpoint's removal to reach the gateway and the EPP
    needed = sleep_s + config.server.drain_timeout_s + (AIOHTTP_SHUTDOWN_S if config.pools.long.url else 0)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= needed + 5, f"{grace} s does not outlast preStop + drain ({needed} s) with margin"
    # A request keeps its stream to the EPP until it ends.
    assert one(objs, "Deployment", "epp")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace


@pytest.mark.parametrize("pool", POOLS)
def test_secrets_come_from_the_secret_under_the_names_the_server_reads(rendered, pool, tmp_path):
    objs = rendered[pool]
    secret = yaml.safe_load(SECRET.read_text())
    _, c = server(objs)
    env = {e["name"]: e for e in c["env"]}
    for name in (TOKEN_ENV, STORE_ENV):
        assert "value" not in env[name], f"{name} is a literal"
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"], name
        assert not ref.get("optional", False), name
    assert find(objs, "Secret") == []  # applying an overlay must never overwrite the real one
    config = server_config(objs, tmp_path)
    assert config.admission.store is None and config.admin.token is None  # not in the ConfigMap either


@pytest.mark.parametrize("pool", POOLS)
def test_prometheus_scrapes_metrics_on_the_server_port(rendered, pool, tmp_path):
    objs = rendered[pool]
    config = server_config(objs, tmp_path)
    deployment, _ = server(objs)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(config.server.port),
        "prometheus.io/path": "/metrics",
    }
    assert config.observability.metrics


@pytest.mark.parametrize("pool", POOLS)
def test_the_hpa_scales_the_deployment_on_the_adapter_metric(rendered, pool):
    objs = rendered[pool]
    deployment, _ = server(objs)
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert "replicas" not in deployment["spec"]  # the HPA owns it; an apply must not reset it
    (metric,) = hpa["spec"]["metrics"]
    rule = adapter_rule()
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    (series,) = NAME.findall(rule["seriesQuery"])
    assert re.search(rule["name"]["matches"], series)
    assert series == "headroom:num_requests_queued"


def test_fallback_shares_cover_every_replica_the_hpas_allow(rendered, tmp_path):
    # Without Redis a replica admits on 1/fleet_size of each budget: fleet_size below the
    # replicas that may run would let the fleet over-admit.
    max_replicas = sum(one(rendered[pool], "HorizontalPodAutoscaler")["spec"]["maxReplicas"] for pool in POOLS)
    for pool in POOLS:
        assert server_config(rendered[pool], tmp_path).admission.fleet_size == max_replicas, pool


def test_the_interactive_pool_proxies_to_the_long_pool_service(rendered, tmp_path):
    url = urlparse(server_config(rendered["interactive"], tmp_path).pools.long.url)
    service = one(rendered["long"], "Service", "server")
    (port,) = service["spec"]["ports"]
    meta = service["metadata"]
    assert (url.scheme, url.hostname, url.port) == ("http", f"{meta['name']}.{meta['namespace']}.svc", port["port"])
    assert server_config(rendered["long"], tmp_path).pools.long.url is None  # no proxy loop


@pytest.mark.parametrize("pool", POOLS)
def test_the_inference_pool_selects_the_servers_and_names_its_epp(rendered, pool):
    objs = rendered[pool]
    deployment, c = server(objs)
    pool_obj = one(objs, "InferencePool")
    assert pool_obj["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool_obj["spec"]
    selector = spec["selector"]["matchLabels"]
    assert selector["headroom.dev/pool"] == pool
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert not selector.items() <= one(objs, "Deployment", "epp")["spec"]["template"]["metadata"]["labels"].items()
    assert [p["number"] for p in spec["targetPorts"]] == [port_number(c, "http")]

    epp_service = one(objs, "Service", "epp")
    ref = spec["endpointPickerRef"]
    assert ref["name"] == epp_service["metadata"]["name"] and ref.get("kind", "Service") == "Service"
    (ext_proc,) = [p for p in epp_service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = container(one(objs, "Deployment", "epp"), "epp")
    assert port_number(epp, ext_proc["targetPort"]) == 9002  # the EPP's ext-proc gRPC port
    args = epp_args(objs)
    assert flag(args, "--pool-name") == pool_obj["metadata"]["name"]
    assert flag(args, "--pool-group") == "inference.networking.k8s.io"
    assert not [a for a in args if a.split("=")[0] in REFUSED_EPP_FLAGS]

    route = one(objs, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_obj["metadata"]["name"]}
    ]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


def test_the_two_routes_do_not_compete_for_the_same_requests(rendered):
    (interactive,) = one(rendered["interactive"], "HTTPRoute")["spec"]["rules"][0]["matches"]
    (long,) = one(rendered["long"], "HTTPRoute")["spec"]["rules"][0]["matches"]
    assert interactive["path"] == long["path"]
    assert "headers" not in interactive and long["headers"]  # the more specific match wins


@pytest.mark.parametrize("pool", POOLS)
def test_the_epp_reads_headrooms_gauges(rendered, pool):
    _, config = epp_config(rendered[pool])
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    assert {k: engine[k] for k in EPP_SPECS} == {
        "queuedRequestsSpec": "headroom:num_requests_queued",
        "runningRequestsSpec": "headroom:num_requests_running",
        "kvUsageSpec": "headroom:kv_cache_usage_perc",
    }
    # headroom has neither; a name it does not export would log an error on every pod.
    assert engine["loraSpec"] == "" and engine["cacheInfoSpec"] == ""
    (source,) = config["data"]["sources"]
    assert source["extractors"] == [{"pluginRef": "core-metrics-extractor"}]


@pytest.fixture(scope="module")
def scraped(default_model) -> str:
    """/metrics of a real server after a real request; and /health must say 503 once draining."""
    from headroom.app.background import BackgroundServer
    from headroom.config import AdmissionConfig, CacheConfig, SchedulerConfig, TenantConfig
    from headroom.runtime.engine import Engine

    config = Config(
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4),
        admission=AdmissionConfig(tenants=(TenantConfig("default"),)),
    )
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        server.app[keys.LIFECYCLE].draining = True  # what SIGTERM sets before the drain
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503  # readiness fails
    finally:
        server.stop()
    return text


@pytest.mark.slow
def test_every_metric_the_manifests_name_is_a_gauge_a_real_server_exports(rendered, scraped):
    types = dict(line.split()[2:4] for line in scraped.splitlines() if line.startswith("# TYPE headroom:"))
    values = {
        line.split()[0]: float(line.split()[1])
        for line in scraped.splitlines()
        if line.startswith("headroom:") and "{" not in line
    }
    named = set(NAME.findall(ADAPTER.read_text()))
    for pool in POOLS:
        text, _ = epp_config(rendered[pool])
        named |= set(NAME.findall(text))
    for name in sorted(named):
        assert types.get(name) == "gauge", name  # the protocol's metrics are gauges: set, not summed
        assert name in values, name
    assert named == {"headroom:num_requests_queued", "headroom:num_requests_running", "headroom:kv_cache_usage_perc"}
    assert 0 <= values["headroom:kv_cache_usage_perc"] <= 1  # a fraction, as vLLM's, not a percent
