"""Features README.md promises, exercised as a user would: the tenant taken from the
X-Tenant header, `--admission off` as plain FCFS, and `headroom predictor calibrate`,
`train` and `eval` end to end."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request

from headroom.app import cli, keys
from headroom.app import predictor_cli as tool
from headroom.app.admission_gate import AdmissionGate
from headroom.app.background import BackgroundServer
from headroom.app.errors import BadRequest, Unauthorized
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ObservabilityConfig,
    SchedulerConfig,
    TenantConfig,
)
from headroom.contracts.request import Priority, SamplingParams
from headroom.prediction.features import RequestFeatures
from headroom.prediction.predictor import LengthPredictor, load_predictor
from headroom.prediction.train import load_records
from headroom.runtime.engine import Engine
from tests.steps import before_each_step

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ADMIN_TOKEN = "readme-admin-token-0123456789"
ACME_KEY = "sk-acme-readme"
BURST = 10**6
# No refill to speak of: a bucket's level drops by exactly the tokens its tenant used.
STILL = {"rate_tokens_per_s": 1e-9, "burst_tokens": BURST, "max_in_flight_tokens": BURST}
TENANTS = (
    TenantConfig("default", **STILL),
    TenantConfig("acme", tier="premium", api_keys=(ACME_KEY,), **STILL),
    TenantConfig("web", **STILL),
)


def chat_body(text: str = "Hi", max_tokens: int = 2) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "ignore_eos": True}


def admin_get(server, path: str) -> dict:
    r = httpx.get(server.url + "/admin" + path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def bucket_levels(server) -> dict[str, float]:
    return {t["name"]: t["bucket_level"] for t in admin_get(server, "/tenants")["data"]}


# ---- the tenant: a known API key, else X-Tenant, else default_tenant (auth off) -----------


@pytest.fixture(scope="module")
def tenant_server(default_model):
    config = Config(
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
        admission=AdmissionConfig(tenants=TENANTS),  # auth off, admission on: the defaults
        admin=AdminConfig(token=ADMIN_TOKEN),
    )
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "headers,owner",
    [
        ({"X-Tenant": "web"}, "web"),
        ({"X-Tenant": "acme"}, "acme"),
        ({"X-Tenant": "web", "Authorization": f"Bearer {ACME_KEY}"}, "acme"),  # a known key wins
        ({}, "default"),
    ],
)
def test_a_request_is_charged_to_the_tenant_it_names(tenant_server, headers, owner):
    assert tenant_server.app[keys.GATE].admission is not None
    before = bucket_levels(tenant_server)
    r = httpx.post(tenant_server.url + CHAT, json=chat_body(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = bucket_levels(tenant_server)
    used = {name: before[name] - after[name] for name in before}
    expected = {name: 0.0 for name in before}
    expected[owner] = usage["prompt_tokens"] + usage["completion_tokens"]
    assert used == pytest.approx(expected, abs=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("path,body", [(CHAT, chat_body()), (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})])
def test_an_unknown_tenant_is_400(tenant_server, path, body):
    started = tenant_server.engine.counters().requests_started
    r = httpx.post(tenant_server.url + path, json=body, headers={"X-Tenant": "nobody"}, timeout=60)
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": "unknown tenant 'nobody'",
            "type": "invalid_request_error",
            "param": "X-Tenant",
            "code": "unknown_tenant",
        }
    }
    assert tenant_server.engine.counters().requests_started == started


def mocked(headers: dict) -> object:
    return make_mocked_request("POST", CHAT, headers=headers)


@pytest.mark.parametrize(
    "auth,headers,owner",
    [
        (False, {"X-Tenant": "web"}, "web"),
        (False, {"X-Tenant": "web", "Authorization": f"Bearer {ACME_KEY}"}, "acme"),
        (False, {"X-Tenant": "web", "Authorization": "Bearer sk-unknown"}, "web"),  # unknown key: the header
        (False, {"Authorization": "Bearer sk-unknown"}, "default"),
        (False, {}, "default"),
        (True, {"X-Tenant": "web", "Authorization": f"Bearer {ACME_KEY}"}, "acme"),
    ],
)
def test_tenant_resolution_order(auth, headers, owner):
    gate = AdmissionGate(Config(admission=AdmissionConfig(enabled=False, auth=auth, tenants=TENANTS)), 8)
    assert gate.tenant(mocked(headers)).name == owner


@pytest.mark.parametrize("headers", [{"X-Tenant": "web"}, {"X-Tenant": "web", "Authorization": "Bearer sk-x"}])
def test_with_auth_on_the_header_names_no_tenant(headers):
    gate = AdmissionGate(Config(admission=AdmissionConfig(enabled=False, auth=True, tenants=TENANTS)), 8)
    with pytest.raises(Unauthorized) as caught:
        gate.tenant(mocked(headers))
    assert (caught.value.status, caught.value.code) == (401, "invalid_api_key")
    with pytest.raises(BadRequest):  # and with auth off, the same unknown name is a 400
        AdmissionGate(Config(admission=AdmissionConfig(enabled=False, tenants=TENANTS)), 8).tenant(
            mocked({"X-Tenant": "nobody"})
        )


# ---- --admission off: plain FCFS -----------------------------------------------------------


def test_the_admission_flag_maps_to_the_config(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "cmd_serve", lambda ns: seen.append(cli.build_config(ns)) or 0)
    assert cli.main(["serve", "--admission", "off"]) == 0
    assert cli.main(["serve", "--admission", "on"]) == 0
    assert cli.main(["serve"]) == 0
    assert [c.admission.enabled for c in seen] == [False, True, True]
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--admission", "maybe"])
    assert caught.value.code == 2


@pytest.fixture(scope="module")
def fcfs_server(default_model):
    config = Config(
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256),
        admission=AdmissionConfig(
            enabled=False,
            tenants=(TenantConfig("default"), TenantConfig("bulk", tier="batch"), TenantConfig("vip", tier="premium")),
        ),
        admin=AdminConfig(token=ADMIN_TOKEN),
        # No head-of-line monitor ticking while the test holds the engine.
        observability=ObservabilityConfig(monitor_interval_s=3600),
    )
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


def wait_until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.slow
def test_admission_off_serves_in_arrival_order_whatever_the_tier(fcfs_server):
    gate = fcfs_server.app[keys.GATE]
    assert gate.admission is None and gate.predictor is None
    engine, client = fcfs_server.engine, fcfs_server.app[keys.ENGINE]
    hold, held = threading.Event(), threading.Event()

    def pause_first_step(out):
        if not held.is_set():
            held.set()
            assert hold.wait(10)

    # The engine stops inside its first step (A's), while B then C arrive behind A.
    # Admission would run C (premium) before B (batch); FCFS runs B first.
    sent = [("a", "bulk", 2), ("b", "bulk", 2), ("c", "vip", 1)]
    results: dict[str, httpx.Response] = {}

    def send(rid: str, tenant: str, max_tokens: int) -> None:
        results[rid] = httpx.post(
            fcfs_server.url + CHAT,
            json=chat_body(f"Say {rid}", max_tokens),
            timeout=60,
            headers={"X-Tenant": tenant, "X-Request-Id": f"fcfs-{rid}"},
        )

    threads = []
    with before_each_step(engine, pause_first_step):
        try:
            for i, (rid, tenant, max_tokens) in enumerate(sent):
                threads.append(threading.Thread(target=send, args=(rid, tenant, max_tokens)))
                threads[-1].start()
                wait_until(lambda n=i + 1: len(client.submitted) == n)
                if i == 0:
                    assert held.wait(10)
            requests = {rid.removeprefix("chatcmpl-fcfs-"): r for rid, r in client.submitted.items()}
        finally:
            hold.set()
            for t in threads:
                t.join(60)
    assert {rid: r.status_code for rid, r in results.items()} == {"a": 200, "b": 200, "c": 200}
    a, b, c = requests["a"], requests["b"], requests["c"]
    assert a.finished_time <= b.first_scheduled_time and b.finished_time <= c.first_scheduled_time
    # Tenants are still resolved; nothing else from admission is set.
    assert [(r.tenant, r.tier) for r in (a, b, c)] == [("bulk", "batch"), ("bulk", "batch"), ("vip", "premium")]
    assert {(r.priority, r.size_class, r.predicted_output_tokens, r.admission.decision) for r in (a, b, c)} == {
        (Priority(), None, None, None)
    }


@pytest.mark.slow
def test_predictor_reload_with_admission_off_is_409(fcfs_server):
    r = httpx.post(
        fcfs_server.url + "/admin/predictor/reload", timeout=30, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert r.status_code == 409
    assert r.json() == {
        "error": {
            "message": "admission is off: there is no predictor to reload",
            "type": "invalid_request_error",
            "param": None,
            "code": "admission_off",
        }
    }


# ---- headroom predictor calibrate / train / eval -------------------------------------------


@pytest.mark.slow
def test_predictor_calibrate_labels_prompts_with_the_models_real_lengths(tmp_path, monkeypatch, capsys, default_model):
    made: list[Engine] = []

    def engine(config):  # the CLI's own engine, on the model this session already loaded
        made.append(Engine(config, loaded=default_model))
        return made[-1]

    monkeypatch.setattr(tool, "Engine", engine)
    rows = [
        {"id": "r1", "prompt": "Is the sky blue? Yes or no.", "max_tokens": 4, "temperature": 0},  # stops early
        {
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Count to 3."}],
            "max_tokens": 2,
            "temperature": 0,
            "tenant": "acme",
        },
        {"prompt": "Say hi.", "temperature": 0},  # no max_tokens: --max-tokens caps it
        {"prompt": "Past --limit: never run."},
    ]
    prompts, labels = tmp_path / "prompts.jsonl", tmp_path / "labels.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = cli.main(
        [
            "predictor",
            "calibrate",
            "--prompts",
            str(prompts),
            "--out",
            str(labels),
            "--limit",
            "3",
            "--max-tokens",
            "2",
            "--concurrency",
            "3",
            "--num-kv-blocks",
            "64",
        ]
    )
    assert code == 0
    assert f"calibrate: wrote 3 records to {labels}" in capsys.readouterr().err
    (eng,) = made
    assert eng.config.scheduler.max_num_seqs == 3

    written = {r["id"]: r for r in map(json.loads, labels.read_text().splitlines())}
    assert set(written) == {"r1", "1", "2"}
    for i, (rid, row) in enumerate(zip(["r1", "1", "2"], rows)):
        out = written[rid]
        assert {k: out[k] for k in row if k != "max_tokens"} == {k: v for k, v in row.items() if k != "max_tokens"}
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        ids = eng.tokenizer.apply_chat_template(messages)
        # What the model really does with real stopping, greedily: the label is exact.
        ref = eng.generate([ids], SamplingParams(max_tokens=row.get("max_tokens", 2), temperature=0))[0]
        assert (out["prompt_tokens"], out["max_tokens"]) == (len(ids), row.get("max_tokens", 2)), i
        assert (out["output_tokens"], out["finish_reason"]) == (ref.num_output_tokens, ref.status.finish_reason), i
    # Real stopping: the first prompt's answer ends (EOS) before its cap.
    assert (written["r1"]["finish_reason"], written["r1"]["output_tokens"]) == ("stop", 3)
    # The labels are what `predictor train` reads.
    assert [r["id"] for r in load_records(labels)] == [
        r["id"] for r in map(json.loads, labels.read_text().splitlines())
    ]


HINTS = {"Answer in one word.": 4, "Write a long, detailed essay about it.": 400}
WORDS = ["river", "market", "engine", "letter", "music", "window", "paper", "cloud", "forest", "city"]


def labelled_rows(n: int) -> list[dict]:
    """Calibration records whose output length follows a hint phrase; every 5th is test."""
    rng = random.Random(7)
    rows = []
    for i in range(n):
        hint = list(HINTS)[i % 2]
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 20))) + ". " + hint
        out = min(256, max(1, int(HINTS[hint] * rng.lognormvariate(0, 0.3))))
        rows.append(
            {
                "id": f"row{i}",
                "split": "test" if i % 5 == 4 else "train",
                "prompt": prompt,
                "max_tokens": 256,
                "temperature": 0.0,
                "prompt_tokens": 20 + len(prompt) // 4,
                "output_tokens": out,
                "finish_reason": "length" if out == 256 else "stop",
            }
        )
    return rows


METRIC_KEYS = {"n", "model", "baseline_max_tokens", "baseline_prompt_tokens", "data"}
MODEL_KEYS = {
    "kendall_tau",
    "spearman",
    "mae_log",
    "class_accuracy",
    "class_accuracy_p90",
    "cap_auc",
    "cap_accuracy",
    "p50_coverage",
    "p90_coverage",
}


def test_predictor_train_then_eval(tmp_path, capsys):
    data, out = tmp_path / "labels.jsonl", tmp_path / "predictor"
    data.write_text("".join(json.dumps(r) + "\n" for r in labelled_rows(70)))  # 56 train, 14 test
    assert cli.main(["predictor", "train", "--data", str(data), "--out", str(out)]) == 0
    trained = capsys.readouterr()
    assert f"predictor saved to {out}" in trained.err
    assert trained.out.startswith("held-out rows: 14 (split field)\n")

    meta = json.loads((out / "meta.json").read_text())
    assert (meta["n_train"], meta["n_test"], meta["holdout"]) == (56, 14, "split field")
    assert set(meta["metrics"]) == METRIC_KEYS | {"holdout"} and set(meta["metrics"]["model"]) == MODEL_KEYS
    assert meta["metrics"]["n"] == 14

    # What the server loads with `predictor_path = DIR`, and it has learned the hint.
    predictor = load_predictor(out)
    assert isinstance(predictor, LengthPredictor)
    served = AdmissionGate(Config(admission=AdmissionConfig(predictor_path=str(out))), 8).predictor
    assert isinstance(served, LengthPredictor) and served.meta["n_train"] == 56

    def p50(hint: str) -> float:
        f = RequestFeatures.from_messages([{"role": "user", "content": f"river city. {hint}"}], 30, 256, 0.0)
        assert predictor.predict(f) == served.predict(f)
        return predictor.predict(f).p50

    assert p50("Answer in one word.") < 20
    assert p50("Write a long, detailed essay about it.") > 100

    # eval scores the split=test rows: the same numbers train printed for its held-out rows.
    assert cli.main(["predictor", "eval", "--data", str(data), "--predictor", str(out)]) == 0
    evaluated = capsys.readouterr().out
    assert evaluated.startswith("held-out rows: 14\n")
    assert evaluated.splitlines()[1:] == trained.out.splitlines()[1:]
    for label in (
        "predictor p50",
        "baseline: max_tokens",
        "baseline: prompt_tokens",
        "MAE of log1p(tokens), p50",
        "size-class accuracy (p50)",
        "p_cap AUC",
        "p90 coverage (actual <= p90)",
    ):
        assert any(line.startswith(label) for line in evaluated.splitlines()), label
    assert cli.main(["predictor", "eval", "--data", str(data), "--predictor", str(out), "--all-rows"]) == 0
    assert capsys.readouterr().out.startswith("held-out rows: 70\n")

    # Too few rows to train on: a clear error, exit 2, nothing written.
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in labelled_rows(20)))
    assert cli.main(["predictor", "train", "--data", str(few), "--out", str(tmp_path / "none")]) == 2
    assert "need at least 50 training records, got 16" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
