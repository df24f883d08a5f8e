"""The admin page in a real headless Chromium against the real server: it finds the runaway,
and its Abort button ends it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from playwright import sync_api

from tests.admin.conftest import ADMIN_TOKEN, admin, plant_runaway, start_stream, wait_until
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow
expect = sync_api.expect

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def browser():
    # A missing browser is a broken setup, not a reason to skip: `make test` installs it.
    assert os.access(CHROMIUM, os.X_OK), f"no Chromium at {CHROMIUM}: run `make browser`"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=60_000)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(f"pageerror: {exc}"))
    page.on(
        "console",
        lambda msg: (
            page.errors.append(f"console: {msg.text} ({msg.location.get('url')})")
            if msg.type == "error" and not msg.location.get("url", "").endswith("/favicon.ico")
            else None
        ),
    )
    yield page
    context.close()


def live_ids(server) -> set[str]:
    return {s.request_id for s in server.engine.snapshot().sequences}


def test_the_page_finds_the_runaway_and_aborts_it(admin_server, page):
    for _ in range(2):  # finished requests, so the TTFT chart has something to draw
        r = httpx.post(admin_server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
    shorts = [
        start_stream(admin_server, {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}, request_id=f"ui-short{i}")
        for i in range(3)
    ]
    runaway = plant_runaway(admin_server, "ui-runaway")
    rid = "cmpl-ui-runaway"
    assert wait_until(lambda: rid in live_ids(admin_server))

    page.goto(admin_server.url + "/admin/ui#token=" + ADMIN_TOKEN)
    # The token moved from the fragment to sessionStorage, and the form stays hidden.
    assert "token" not in page.url
    expect(page.locator("#token-form")).to_be_hidden()

    rows = page.locator("#sequences tbody tr[data-seq-id]")
    expect(rows.first).to_have_attribute("data-seq-id", rid, timeout=TIMEOUT_MS)
    expect(page.locator("#kv")).to_contain_text(re.compile(r"\b[1-9]\d* / 512 blocks"))
    expect(page.locator("#hol")).to_contain_text("coupled")
    expect(page.locator("#hol")).to_contain_text("pool spread (10 m)– (under 20 finished requests)")
    expect(page.locator("#tenants tbody tr")).to_have_count(2)
    box = page.locator("#ttft-chart").bounding_box()
    assert box is not None and box["width"] > 100 and box["height"] > 50
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "admin-ui.png"), full_page=True)

    row = page.locator(f'#sequences tbody tr[data-seq-id="{rid}"]')
    row.locator('button[data-action="abort"]').click()

    runaway.wait(60)
    assert runaway.id == rid
    assert runaway.finish_reason == "abort"
    assert runaway.final_choice["stop_reason"] == "aborted by admin: aborted from the admin page"
    expect(row).to_have_count(0)
    assert rid not in live_ids(admin_server)
    expect(page.locator("#status")).to_contain_text(f"abort {rid}: done")
    # It stays gone on later polls.
    page.wait_for_timeout(1500)
    expect(row).to_have_count(0)

    for i, stream in enumerate(shorts):
        r = admin(admin_server, "POST", f"/sequences/cmpl-ui-short{i}/abort")
        assert r.status_code in (200, 404, 409), r.text  # 404/409: it had finished on its own
        stream.wait(60)
        assert stream.finish_reason in ("abort", "length")
    wait_idle(admin_server.engine, timeout=30)
    admin_server.engine.block_manager.check_invariants()
    expect(page.locator("#sequences tbody")).to_contain_text("no live sequences")
    assert page.errors == []


def test_without_a_token_the_page_asks_for_one(admin_server, page):
    ok_calls = []
    page.on(
        "response",
        lambda r: ok_calls.append(r.url) if "/admin/" in r.url and not r.url.endswith("/admin/ui") and r.ok else None,
    )
    page.goto(admin_server.url + "/admin/ui")
    form = page.locator("#token-form")
    expect(form).to_be_visible()
    expect(page.locator("#status")).to_contain_text("enter the admin token")
    page.wait_for_timeout(1500)  # a few poll periods: nothing is fetched without a token
    assert ok_calls == []
    assert page.locator("#sequences tbody tr[data-seq-id]").count() == 0

    # A wrong token: the API's own message, and the form again.
    page.fill("#token-input", "not-the-admin-token")
    page.click("#token-form button[type=submit]")
    expect(page.locator("#status")).to_contain_text("the admin API needs its bearer token")
    expect(form).to_be_visible()
    assert ok_calls == []
    assert page.evaluate("sessionStorage.getItem('headroom-admin-token')") is None

    # The right one: the data arrives.
    page.fill("#token-input", ADMIN_TOKEN)
    page.click("#token-form button[type=submit]")
    expect(form).to_be_hidden()
    expect(page.locator("#kv")).to_contain_text("/ 512 blocks")
    expect(page.locator("#tenants tbody tr")).to_have_count(2)
    assert ok_calls
    # The only errors are the browser's notes on the refused (401) calls.
    assert all("401" in e for e in page.errors), page.errors
