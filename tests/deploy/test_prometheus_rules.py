"""deploy/prometheus/rules.yml under `promtool` (Debian's `prometheus` package, which
`make test` installs): the rules are valid, the unit tests in prometheus_rules_test.yml
pass, and they fail when a rule is broken the way a careless edit would break it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
TESTS = Path(__file__).with_name("prometheus_rules_test.yml")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: `make test` installs Debian's prometheus package"
    return subprocess.run([tool, *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_rules_are_valid():
    run = promtool("check", "rules", str(RULES), cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS: 25 rules found" in run.stdout


def test_the_alerts_fire_where_they_must_and_nowhere_else():
    run = promtool("test", "rules", TESTS.name, cwd=TESTS.parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("SUCCESS")


@pytest.mark.parametrize(
    "old,new,broken",
    [
        # Without the "aggregate under it" half, (a) fires on a general slowdown too.
        (
            """          and on(size_class)
          (headroom:ttft_slo_seconds > on() group_left() headroom:ttft_seconds:p99_5m:all)
""",
            "",
            "alertname: HeadroomClassTTFTOverSLO",
        ),
        # A looser short objective hides the short class's 2.5 s p99.
        (
            """        expr: vector(1)
        labels:
          size_class: short""",
            """        expr: vector(3)
        labels:
          size_class: short""",
            "alertname: HeadroomClassTTFTOverSLO",
        ),
        # Thrashing without preemptions is just a full pool.
        (
            "          and on() rate(headroom:num_preemptions_total[5m]) > 0\n",
            "\n",
            "alertname: HeadroomKVCacheThrashing",
        ),
        ("        expr: vector(0.8)", "        expr: vector(0.95)", "alertname: HeadroomTenantDeviceShare"),
        # Reading the instant value: a 5-minute spike would fire the advice.
        (
            'min_over_time(headroom:pool_split_ratio{measure="tokens"}[10m]) > 10',
            'headroom:pool_split_ratio{measure="tokens"} > 10',
            "alertname: HeadroomPoolSplitAdvised",
        ),
        # Looser floors hide a tau of 0.30 and a probe's AUC of 0.60.
        ("        expr: vector(0.35)", "        expr: vector(0.25)", "alertname: HeadroomPredictorRankingDrift"),
        ("        expr: vector(0.65)", "        expr: vector(0.55)", "alertname: HeadroomPredictorCapAUCDrift"),
        # Server-wide alone: one tenant's traffic the predictor misjudges goes unseen.
        (
            (
                "          or\n          headroom:tenant_predictor_cap_auc\n"
                "            < on(predictor) group_left() headroom:predictor_cap_auc_floor\n"
            ),
            "",
            "alertname: HeadroomPredictorCapAUCDrift",
        ),
        # A short wait fires on a window's chance dip.
        ("        for: 30m\n", "        for: 5m\n", "alertname: HeadroomPredictorRankingDrift"),
        # A fixed floor for the flag's precision: right or wrong depending on how many runaways come.
        (
            "headroom:probe_flag_precision <= headroom:predictor_cap_rate",
            "headroom:probe_flag_precision <= 0.5",
            "alertname: HeadroomProbeFlagImprecise",
        ),
    ],
)
def test_a_broken_rule_fails_its_test(tmp_path, old, new, broken):
    rules = RULES.read_text(encoding="utf-8")
    assert old in rules
    (tmp_path / "rules.yml").write_text(rules.replace(old, new), encoding="utf-8")
    tests = TESTS.read_text(encoding="utf-8").replace("../../deploy/prometheus/rules.yml", "rules.yml")
    (tmp_path / "tests.yml").write_text(tests, encoding="utf-8")
    run = promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert run.returncode == 1
    assert "FAILED" in run.stdout + run.stderr and broken in run.stdout + run.stderr
