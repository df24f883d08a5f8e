"""docker-compose.yml wires headroom's OTLP exporter to a Jaeger that can receive it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict:
    with COMPOSE.open() as f:
        return yaml.safe_load(f)["services"]


def environment(service: dict) -> dict[str, str]:
    """A service's environment, whether written as a mapping or as a list of K=V."""
    env = service.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): "" if v is None else str(v) for k, v in env.items()}
    pairs = (item.split("=", 1) for item in env)
    return {pair[0]: pair[1] if len(pair) == 2 else "" for pair in pairs}


def published(service: dict) -> dict[int, int]:
    """host port -> container port for each port the service publishes (short or long syntax)."""
    out = {}
    for port in service.get("ports", []):
        if isinstance(port, dict):
            target = int(port["target"])
            out[int(port.get("published", target))] = target
            continue
        spec = str(port).split("/", 1)[0]  # drop a /tcp or /udp suffix
        parts = spec.split(":")
        container = int(parts[-1])
        host = int(parts[-2]) if len(parts) >= 2 else container
        out[host] = container
    return out


def container_ports(service: dict) -> set[int]:
    return set(published(service).values()) | {int(str(p).split("/")[0]) for p in service.get("expose", [])}


def depends_on(service: dict) -> set[str]:
    deps = service.get("depends_on") or []
    return set(deps.keys()) if isinstance(deps, dict) else set(deps)


def build_context(service: dict) -> str:
    build = service["build"]
    return build if isinstance(build, str) else build.get("context", ".")


def test_both_services_exist(services):
    assert {"jaeger", "headroom"} <= set(services)


def test_jaeger_is_all_in_one(services):
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")


def test_jaeger_publishes_ui_and_otlp_ports(services):
    ports = published(services["jaeger"])
    for port in (16686, 4317, 4318):
        assert ports.get(port) == port


def test_headroom_builds_from_repo_root(services):
    assert build_context(services["headroom"]) == "."


def test_dockerfile_of_build_context_exists(services):
    build = services["headroom"]["build"]
    dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
    assert (ROOT / build_context(services["headroom"]) / dockerfile).is_file()


def test_headroom_exports_otlp_grpc_to_jaeger(services):
    env = environment(services["headroom"])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert env["OTEL_SERVICE_NAME"] == "headroom"


def test_headroom_depends_on_jaeger(services):
    assert "jaeger" in depends_on(services["headroom"])


def test_headroom_publishes_8000(services):
    assert published(services["headroom"]).get(8000) == 8000


def test_endpoint_names_a_port_jaeger_exposes(services):
    url = urlparse(environment(services["headroom"])["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert url.hostname in services
    assert url.hostname == "jaeger"
    assert url.port in container_ports(services[url.hostname])


def mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of each bind mount (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = str(volume).split(":")[:2]
        out[container] = ROOT / host
    return out


def test_prometheus_scrapes_headroom_and_loads_the_rules(services):
    prometheus = services["prometheus"]
    assert published(prometheus).get(9090) == 9090
    files = mounts(prometheus)
    assert files["/etc/prometheus/rules.yml"] == ROOT / "deploy" / "prometheus" / "rules.yml"
    config = yaml.safe_load(files["/etc/prometheus/prometheus.yml"].read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]
    [job] = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    [target] = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "headroom" and int(port) in container_ports(services["headroom"])
    # headroom's /metrics needs its token (SECURITY.md): Prometheus sends the one headroom has.
    assert job["authorization"] == {
        "type": "Bearer",
        "credentials": services["headroom"]["environment"]["HEADROOM_METRICS_TOKEN"],
    }
    assert "headroom" in depends_on(prometheus)


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(services):
    grafana = services["grafana"]
    files = mounts(grafana)
    provisioning = files["/etc/grafana/provisioning"]
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    url = urlparse(source["url"])
    assert (source["type"], source["uid"], url.hostname) == ("prometheus", "prometheus", "prometheus")
    assert url.port in container_ports(services["prometheus"])
    [provider] = yaml.safe_load((provisioning / "dashboards" / "headroom.yml").read_text())["providers"]
    dashboard = files[provider["options"]["path"] + "/headroom.json"]
    assert dashboard == ROOT / "deploy" / "grafana" / "headroom.json" and dashboard.is_file()
    assert published(grafana).get(3000) == 3000 and "prometheus" in depends_on(grafana)
