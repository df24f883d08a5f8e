"""The predictors' health: exact figures on records computed by hand, which finished
requests count, the per-tenant minimum, the window's bound, and the Prometheus families
(server-wide and per tenant) they are exported as."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from headroom.config import ConfigError, ObservabilityConfig
from headroom.observability.finished import FinishedRequest
from headroom.observability.metrics import PredictorHealthCollector
from headroom.observability.predictor_health import Figures, PredictorHealth


def finished(
    tenant: str,
    predicted: float | None,
    output: int,
    finish: str = "stop",
    p: float | None = None,
    flagged: bool = False,
    **fields,
) -> FinishedRequest:
    return FinishedRequest(
        request_id="r",
        endpoint="/v1/completions",
        model="m",
        http_status=200,
        tenant=tenant,
        tier="standard",
        size_class="short",
        ran=True,
        output_tokens=output,
        max_tokens=100,
        finish_reason=finish,
        predicted_output_tokens=predicted,
        runaway_probability=p,
        runaway_flagged_at=16 if flagged else None,
        **fields,
    )


# Six requests, max_tokens 100 each (so admission's score is predicted / 100):
#       tenant predicted actual finish  probe p flagged
# r1    a        10      12    stop     0.1
# r2    a        30      20    stop     0.3
# r3    a        50     100    length   0.9     yes
# r4    a       100     100    length   0.8     yes
# r5    b       100      40    stop     0.85    yes
# r6    b        20     100    length   0.3
SIX = [
    finished("a", 10, 12, p=0.1),
    finished("a", 30, 20, p=0.3),
    finished("a", 50, 100, "length", p=0.9, flagged=True),
    finished("a", 100, 100, "length", p=0.8, flagged=True),
    finished("b", 100, 40, p=0.85, flagged=True),
    finished("b", 20, 100, "length", p=0.3),
]
# By hand, all six:
# - Kendall tau-b. Of the 15 pairs, concordant (C): r1 with each of r2..r6, r2 with r3, r4,
#   r5: 8. Discordant (D): r2-r6, r3-r5, r5-r6: 3. Tied in predicted only: r4-r5 (1 pair);
#   in actual only: r3-r4, r3-r6, r4-r6 (3 pairs). tau-b = (C - D) / sqrt((15 - 1)(15 - 3))
#   = 5 / sqrt(168).
# - MAE: (2 + 10 + 50 + 0 + 60 + 80) / 6 = 202 / 6.
# - Admission's run-to-cap AUC, score predicted / 100: runs to cap r3 (0.5), r4 (1.0), r6
#   (0.2) against r1 (0.1), r2 (0.3), r5 (1.0): r3 beats 2, r4 beats 2 and ties r5 (2.5),
#   r6 beats 1: 5.5 of 9 pairs.
# - The probe's AUC: r3 (0.9) beats all 3, r4 (0.8) beats 2, r6 (0.3) beats r1 and ties r2
#   (1.5): 6.5 of 9.
# - Flag precision: flagged r3, r4, r5, of which r3 and r4 ran to their cap: 2 / 3.
# - Cap rate: 3 of 6.
ALL_SIX = Figures(
    requests=6,
    cap_rate=0.5,
    kendall_tau=5 / math.sqrt(168),
    mae_tokens=202 / 6,
    admission_cap_auc=5.5 / 9,
    probe_cap_auc=6.5 / 9,
    flag_precision=2 / 3,
)
# Tenant a alone (r1-r4): 5 concordant pairs of 6, none discordant, r3-r4 tied in actual:
# tau-b = 5 / sqrt(6 * 5); MAE 62 / 4; both AUCs 1 (each cap run outscores both others);
# two flagged, under a minimum of 3: no precision.
TENANT_A = Figures(
    requests=4,
    cap_rate=0.5,
    kendall_tau=5 / math.sqrt(30),
    mae_tokens=62 / 4,
    admission_cap_auc=1.0,
    probe_cap_auc=1.0,
    flag_precision=None,
)


def health_of(records: list[FinishedRequest], window: int = 100, min_requests: int = 3) -> PredictorHealth:
    health = PredictorHealth(window, min_requests)
    for r in records:
        health.observe(r)
    return health


def figures(f: Figures) -> dict:
    return vars(f)


def test_the_six_records_by_hand():
    report = health_of(SIX).report()
    assert figures(report.server) == pytest.approx(figures(ALL_SIX), abs=1e-12)


def test_only_requests_whose_natural_length_is_known_count():
    unknown = [
        finished("a", 10, 5, "abort", p=0.2),  # cut short: its length says nothing
        finished("a", 10, 30, "repetition", p=0.9),  # ended by the loop detector
        finished("a", 10, 50, "length", p=0.9, max_tokens_cap=50),  # an operator's cap, not its own
        finished("a", 10, 60, "length", p=0.9, stop_reason="wall_clock_budget"),  # out of time
        finished("a", 10, 100, "length", p=1.0, ignore_eos=True),  # only max_tokens could end it
        finished("a", None, 40),  # neither predictor said anything
        FinishedRequest(
            request_id="r",
            endpoint="/v1/completions",
            model="m",
            http_status=429,
            tenant="a",
            tier="standard",
            size_class="none",
            ran=False,
        ),
    ]
    report = health_of(SIX[:3] + unknown + SIX[3:]).report()
    assert figures(report.server) == pytest.approx(figures(ALL_SIX), abs=1e-12)
    # Admission off or the probe off: each request counts for the predictor that spoke.
    probe_only = [
        finished("a", None, 10, p=0.2),
        finished("a", None, 100, "length", p=0.7),
        finished("a", None, 100, "length", p=0.1),
    ]
    only_probe = health_of(probe_only, min_requests=2).report().server
    assert (only_probe.requests, only_probe.kendall_tau, only_probe.admission_cap_auc) == (3, None, None)
    assert only_probe.probe_cap_auc == pytest.approx(0.5)  # 0.7 beats 0.2, 0.1 does not


@pytest.mark.parametrize("finish, output, cap", [("length", 72, 72), ("repetition", 44, None)])
def test_a_loop_the_detector_cut_counts_as_a_run_to_the_requested_max_tokens(finish, output, cap):
    # r6 as the loop detector would leave it, capped 32 tokens after the loop or stopped.
    cut = finished("b", 20, output, finish, p=0.3, max_tokens_cap=cap, loop_detected_at=40, requested_max_tokens=100)
    report = health_of(SIX[:5] + [cut]).report()
    assert figures(report.server) == pytest.approx(figures(ALL_SIX), abs=1e-12)


def test_a_tenant_under_the_minimum_has_no_figures():
    report = health_of(SIX, min_requests=3).report()
    assert list(report.tenants) == ["a", "b"]
    assert figures(report.tenants["a"]) == pytest.approx(figures(TENANT_A), abs=1e-12)
    # b has 2 requests: counted, but every figure absent rather than computed from two.
    assert figures(report.tenants["b"]) == {
        "requests": 2,
        "cap_rate": None,
        "kendall_tau": None,
        "mae_tokens": None,
        "admission_cap_auc": None,
        "probe_cap_auc": None,
        "flag_precision": None,
    }
    # One more of b's reaches the minimum: b's figures (r5, r6 and r7, a stop at 30 of
    # predicted 60, probe 0.2): predicted 100, 20, 60 against 40, 100, 30: r5-r7 concordant,
    # r5-r6 and r6-r7 discordant: tau -1/3; MAE (60 + 80 + 30) / 3; admission's AUC: r6 (0.2)
    # under both: 0; the probe's: r6 (0.3) beats r7 (0.2), not r5: 1/2; one flagged: no precision.
    report = health_of([*SIX, finished("b", 60, 30, p=0.2)], min_requests=3).report()
    assert figures(report.tenants["b"]) == pytest.approx(
        {
            "requests": 3,
            "cap_rate": 1 / 3,
            "kendall_tau": -1 / 3,
            "mae_tokens": 170 / 3,
            "admission_cap_auc": 0.0,
            "probe_cap_auc": 0.5,
            "flag_precision": None,
        },
        abs=1e-12,
    )
    # The same minimum server-wide: at 4, three flagged requests give no precision either.
    assert health_of(SIX, min_requests=4).report().server.flag_precision is None


def test_the_window_holds_the_last_n_requests():
    health = PredictorHealth(window=4, min_requests=2)
    for i in range(6):  # wildly wrong, and from tenants that will leave the window
        health.observe(finished(f"old{i}", 100, 1, p=0.5))
    for actual in (10, 20, 30, 40):  # each predicted one token high
        health.observe(finished("new", actual + 1, actual, p=0.5))
    report = health.report()
    assert (report.window, report.server.requests, list(report.tenants)) == (4, 4, ["new"])
    assert report.server.mae_tokens == pytest.approx(1.0)
    assert report.server.kendall_tau == pytest.approx(1.0)
    health.clear()
    assert health.report().server.requests == 0 and health.report().tenants == {}


def test_exported_server_wide_and_per_tenant():
    registry = CollectorRegistry()
    registry.register(PredictorHealthCollector(health_of(SIX)))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples == pytest.approx(
        {
            ("headroom:predictor_health_requests", ()): 6,
            ("headroom:predictor_cap_rate", ()): 0.5,
            ("headroom:predictor_kendall_tau", ()): ALL_SIX.kendall_tau,
            ("headroom:predictor_mae_tokens", ()): ALL_SIX.mae_tokens,
            ("headroom:predictor_cap_auc", (("predictor", "admission"),)): 5.5 / 9,
            ("headroom:predictor_cap_auc", (("predictor", "probe"),)): 6.5 / 9,
            ("headroom:probe_flag_precision", ()): 2 / 3,
            ("headroom:tenant_predictor_health_requests", (("tenant", "a"),)): 4,
            ("headroom:tenant_predictor_health_requests", (("tenant", "b"),)): 2,
            ("headroom:tenant_predictor_cap_rate", (("tenant", "a"),)): 0.5,
            ("headroom:tenant_predictor_kendall_tau", (("tenant", "a"),)): TENANT_A.kendall_tau,
            ("headroom:tenant_predictor_mae_tokens", (("tenant", "a"),)): 15.5,
            ("headroom:tenant_predictor_cap_auc", (("predictor", "admission"), ("tenant", "a"))): 1.0,
            ("headroom:tenant_predictor_cap_auc", (("predictor", "probe"), ("tenant", "a"))): 1.0,
        },
        abs=1e-12,
    )


@pytest.mark.parametrize("window,minimum", [(500, 1), (40, 50)])
def test_the_minimum_is_at_least_two_and_at_most_the_window(window, minimum):
    with pytest.raises(ConfigError, match="predictor_health_min_requests"):
        ObservabilityConfig(predictor_health_window=window, predictor_health_min_requests=minimum)
