"""The predictors' health on this deployment's own traffic: over the last N finished
requests, how well admission's output-length prediction ranked and sized them, and how
well it and the length probe told apart the sequences that ran to their max_tokens,
server-wide and per tenant. Their quality is otherwise a bench figure, measured once on
calibration prompts; this says whether it still holds on today's traffic.

The window is one bounded deque of requests (not one per tenant), so memory and the
number of tenant label values stay bounded by N whatever the number of tenants. A
figure computed from fewer than `min_requests` of its sample is None: a tau or an AUC
over a dozen requests is noise, and an alert on it would flap."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from scipy import stats

from headroom.observability.finished import FinishedRequest

NO_TENANT = "none"


@dataclass(frozen=True)
class Outcome:
    """What the predictors said about one finished request, and what it did."""

    tenant: str
    output_tokens: int
    max_tokens: int
    ran_to_cap: bool  # finish_reason "length", the label both predictors were trained on
    predicted_tokens: float | None  # admission's p50 (None with admission off)
    runaway_probability: float | None  # the probe's last estimate (None with the probe off)
    flagged: bool  # the probe put it at or over runaway_threshold at some point

    @classmethod
    def of_loop(cls, done: FinishedRequest) -> Outcome | None:
        if not done.ran or done.finish_reason not in ("length", "repetition") or done.ignore_eos:
            return None
        if done.predicted_output_tokens is None and done.runaway_probability is None:
            return None
        return cls(
            tenant=done.tenant or NO_TENANT,
            output_tokens=done.requested_max_tokens,
            max_tokens=done.requested_max_tokens,
            ran_to_cap=True,
            predicted_tokens=done.predicted_output_tokens,
            runaway_probability=done.runaway_probability,
            flagged=done.runaway_flagged_at is not None,
        )

    @classmethod
    def of(cls, done: FinishedRequest) -> Outcome | None:
        """None when its natural length is unknown or nothing predicted it: it did not
        run, was aborted, was cut by a cap (an operator's or a policy's: its label would be
        theirs) or a wall-clock budget, or ignored EOS (only max_tokens could end it). A sequence the loop
        detector capped or stopped counts as one that ran to its requested max_tokens:
        loops rarely end on their own (bench/RESULTS.md, loop detection), and leaving
        them out would hide most runaways from the window once the detector acts."""
        if done.loop_detected_at is not None and (
            done.finish_reason == "repetition" or done.max_tokens_cap is not None
        ):
            return cls.of_loop(done)
        if not done.ran or done.finish_reason not in ("stop", "length") or done.max_tokens is None:
            return None
        if done.max_tokens_cap is not None or done.ignore_eos or done.stop_reason == "wall_clock_budget":
            return None
        if done.predicted_output_tokens is None and done.runaway_probability is None:
            return None
        return cls(
            tenant=done.tenant or NO_TENANT,
            output_tokens=done.output_tokens,
            max_tokens=done.max_tokens,
            ran_to_cap=done.finish_reason == "length",
            predicted_tokens=done.predicted_output_tokens,
            runaway_probability=done.runaway_probability,
            flagged=done.runaway_flagged_at is not None,
        )


@dataclass(frozen=True)
class Figures:
    requests: int  # outcomes in the sample
    cap_rate: float | None  # share that ran to their cap: the flag precision's chance level
    kendall_tau: float | None  # tau-b of admission's predicted against actual output tokens
    mae_tokens: float | None  # mean |predicted - actual| output tokens
    # Run-to-cap AUC, admission's predicted share of max_tokens as the score (its
    # p_cap does not reach the finished request), and the probe's last probability.
    admission_cap_auc: float | None
    probe_cap_auc: float | None
    flag_precision: float | None  # of those the probe flagged, the share that ran to their cap

    @classmethod
    def of(cls, outcomes: list[Outcome], min_requests: int) -> Figures:
        predicted = [o for o in outcomes if o.predicted_tokens is not None]
        probed = [o for o in outcomes if o.runaway_probability is not None]
        flagged = [o for o in probed if o.flagged]
        tau = mae = admission_auc = probe_auc = precision = None
        if len(predicted) >= min_requests:
            guess = np.array([o.predicted_tokens for o in predicted])
            actual = np.array([o.output_tokens for o in predicted], dtype=np.float64)
            tau = kendall_tau_b(guess, actual)
            mae = float(np.mean(np.abs(guess - actual)))
            share = guess / np.array([o.max_tokens for o in predicted], dtype=np.float64)
            admission_auc = auc(share, np.array([o.ran_to_cap for o in predicted]))
        if len(probed) >= min_requests:
            probe_auc = auc(np.array([o.runaway_probability for o in probed]), np.array([o.ran_to_cap for o in probed]))
        if len(flagged) >= min_requests:
            precision = sum(o.ran_to_cap for o in flagged) / len(flagged)
        cap_rate = None
        if len(outcomes) >= min_requests:
            cap_rate = sum(o.ran_to_cap for o in outcomes) / len(outcomes)
        return cls(len(outcomes), cap_rate, tau, mae, admission_auc, probe_auc, precision)


@dataclass(frozen=True)
class HealthReport:
    window: int
    min_requests: int
    server: Figures
    tenants: dict[str, Figures]


class PredictorHealth:
    def __init__(self, window: int, min_requests: int):
        self.window = window
        self.min_requests = min_requests
        self._outcomes: deque[Outcome] = deque(maxlen=window)

    def observe(self, done: FinishedRequest) -> None:
        outcome = Outcome.of(done)
        if outcome is not None:
            self._outcomes.append(outcome)

    def clear(self) -> None:
        """Start over: a reloaded predictor is a new model, not the old one drifting."""
        self._outcomes.clear()

    def report(self) -> HealthReport:
        outcomes = list(self._outcomes)
        by_tenant: dict[str, list[Outcome]] = {}
        for o in outcomes:
            by_tenant.setdefault(o.tenant, []).append(o)
        minimum = self.min_requests
        tenants = {t: Figures.of(os, minimum) for t, os in sorted(by_tenant.items())}
        return HealthReport(self.window, minimum, Figures.of(outcomes, minimum), tenants)


def kendall_tau_b(x: np.ndarray, y: np.ndarray) -> float | None:
    """Tau-b (ties in either ranking shrink the denominator); None when either is constant."""
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(stats.kendalltau(x, y, variant="b").statistic)


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """Mann-Whitney: the chance that a random positive outscores a random negative, ties
    counting half. None without both classes."""
    n_pos = int(label.sum())
    n_neg = len(label) - n_pos
    if not n_pos or not n_neg:
        return None
    ranks = stats.rankdata(score)  # ties get their mean rank: half a win each way
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
