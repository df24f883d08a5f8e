"""Tenants cannot see or act on each other's sequences through the public API."""

from __future__ import annotations

import httpx
import pytest

from tests.admin.conftest import TENANT_KEY, start_stream, wait_until

pytestmark = pytest.mark.slow


def test_another_tenants_request_id_is_neither_revealed_nor_blocked(admin_server):
    body = {"prompt": "Go on:", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    alone = start_stream(admin_server, body, request_id="undisturbed").wait()
    # The default tenant (no key) has a sequence in flight under a known id ...
    theirs = start_stream(admin_server, body, request_id="shared-id")
    assert wait_until(lambda: any(s.request_id == "cmpl-shared-id" for s in admin_server.engine.snapshot().sequences))
    # ... and tenant acme sends the same X-Request-Id: no 409 (that would reveal it), no
    # interference: acme's request gets a fresh id of its own.
    mine = start_stream(
        admin_server, {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}, request_id="shared-id", api_key=TENANT_KEY
    ).wait()
    assert mine.finish_reason == "length"
    assert mine.id.startswith("cmpl-") and mine.id != "cmpl-shared-id"
    assert {c["id"] for c in mine.chunks} == {mine.id}
    # The same tenant repeating its own in-flight id is its own conflict.
    r = httpx.post(
        admin_server.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "shared-id"},
        timeout=30,
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "duplicate_request_id"
    # Theirs ran on untouched: the same tokens as the same request run alone.
    theirs.wait()
    assert theirs.id == "cmpl-shared-id" and theirs.finish_reason == "length"
    assert theirs.text == alone.text and len(alone.text) > 0
