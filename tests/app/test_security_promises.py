"""Promises from SECURITY.md that no other test backs: spans carry no prompt text, the
admin page's Content-Security-Policy, API keys compared against every key, prefix-cache
keys that are a blake2b chain, and top_p validated at the HTTP boundary."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import struct
import time

import httpx
import pytest

from headroom.admission import tenants as tenants_module
from headroom.admission.tenants import TenantRegistry
from headroom.app.background import BackgroundServer
from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    SchedulerConfig,
    TenantConfig,
)
from headroom.contracts.request import Request, SamplingParams
from headroom.runtime.block_manager import BlockManager, block_key
from headroom.runtime.engine import Engine
from tests.observability.test_tracing_otlp import Collected, HttpReceiver, attributes

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ADMIN_TOKEN = "security-admin-token-0123456789"
SECRET = "zebra-marmalade-7731"
# The model echoes it back, so the generated text is distinctive too.
CHAT_PROMPT = f"Repeat exactly: {SECRET}"
CONFIG = Config(
    cache=CacheConfig(num_blocks=128),
    scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
    admin=AdminConfig(token=ADMIN_TOKEN),
)
PHASES = {"admission", "queue", "prefill", "decode"}


@pytest.fixture(scope="module")
def receiver():
    r = HttpReceiver(Collected())
    yield r
    r.stop()


@pytest.fixture(scope="module")
def server(default_model, receiver):
    with pytest.MonkeyPatch.context() as mp:  # read once, when the app is created
        mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
        mp.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        srv = BackgroundServer(CONFIG, Engine(CONFIG, loaded=default_model)).start()
    yield srv
    srv.stop()


def span_list(receiver: HttpReceiver) -> list:
    with receiver.collected.lock:
        return [span for _, span in receiver.collected.spans]


def strings(obj) -> list[str]:
    """Every string inside an attribute value (bytes decoded), however nested."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, bytes):
        return [obj.decode("utf-8", "replace")]
    if isinstance(obj, list):
        return [s for x in obj for s in strings(x)]
    if isinstance(obj, dict):
        return [s for k, x in obj.items() for s in [k, *strings(x)]]
    return []


def span_texts(span) -> list[str]:
    """All the text a span carries: its name, status message, attribute keys and values,
    and its events' and links' names and attributes."""
    texts = [span.name, span.status.message, *strings(attributes(span.attributes))]
    for event in span.events:
        texts += [event.name, *strings(attributes(event.attributes))]
    for link in span.links:
        texts += strings(attributes(link.attributes))
    return texts


def roots_by_id(spans: list) -> dict:
    """Each request's root span by the response id it carries (phases carry none)."""
    found = {}
    for span in spans:
        rid = attributes(span.attributes).get("gen_ai.response.id")
        if rid is not None:
            found[rid] = span
    return found


def wait_for_spans(receiver: HttpReceiver, finished: set[str], refused: set[str], timeout: float = 10.0) -> list:
    """The spans exported so far, once every finished request's root and its four phases,
    and every refused request's root, are in."""
    deadline = time.monotonic() + timeout
    while True:
        spans = span_list(receiver)
        roots = roots_by_id(spans)
        done = refused <= set(roots) and all(
            i in roots and {c.name for c in spans if c.parent_span_id == roots[i].span_id} == PHASES for i in finished
        )
        if done or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def assert_openai_error(r: httpx.Response, status: int, code: str, param: str | None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    return error


# ---- spans carry token counts and timings, never text --------------------------------------


@pytest.mark.slow
def test_spans_never_carry_prompt_or_generated_text(server, receiver):
    chat = httpx.post(
        server.url + CHAT,
        timeout=60,
        headers={"X-Request-Id": "sec-chat"},
        json={"messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 4, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    generated = chat.json()["choices"][0]["message"]["content"]
    # The check below means something only if the output is as distinctive as the prompt.
    assert generated.lower().startswith("zebra-"), generated
    with httpx.stream(
        "POST",
        server.url + COMPLETIONS,
        timeout=60,
        headers={"X-Request-Id": "sec-cmpl"},
        json={"prompt": f"{SECRET} {SECRET}", "max_tokens": 3, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: ") :]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # Refused after tokenising (too long for the context): its span has an error message.
    refused = httpx.post(
        server.url + CHAT,
        timeout=60,
        headers={"X-Request-Id": "sec-long"},
        json={"messages": [{"role": "user", "content": CHAT_PROMPT}], "max_tokens": 10**6},
    )
    assert_openai_error(refused, 400, "context_length_exceeded", "max_tokens")

    ids = {"chatcmpl-sec-chat", "cmpl-sec-cmpl"}
    spans = wait_for_spans(receiver, ids, {"chatcmpl-sec-long"})
    roots = roots_by_id(spans)
    # The spans were exported: both requests' roots, each with its four phases, and the
    # refused request's root with its error.
    assert ids <= set(roots)
    for rid in ids:
        assert {c.name for c in spans if c.parent_span_id == roots[rid].span_id} == PHASES
        assert attributes(roots[rid].attributes)["gen_ai.usage.input_tokens"] > 0
    failed = attributes(roots["chatcmpl-sec-long"].attributes)
    assert failed["http.response.status_code"] == 400
    assert failed["headroom.error"].startswith("context_length_exceeded: ")

    ours = [s for s in spans if s.trace_id in {roots[i].trace_id for i in (*ids, "chatcmpl-sec-long")}]
    assert len(ours) == 2 * (1 + len(PHASES)) + 1
    needles = [SECRET, "zebra", "marmalade", "7731", generated.strip()]
    for span in ours:
        for text in span_texts(span):
            for needle in needles:
                assert needle.lower() not in text.lower(), (span.name, text)
    # Nor anywhere on the wire: no field of any export holds the prompt's bytes.
    raw = b"".join(receiver.collected.raw)
    assert raw and SECRET.encode() not in raw and b"marmalade" not in raw


# ---- the admin page's Content-Security-Policy ----------------------------------------------


@pytest.mark.slow
def test_admin_page_sets_its_content_security_policy(server):
    r = httpx.get(server.url + "/admin/ui", timeout=10)  # the one admin route open without the token
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/html")
    # Inline code runs only by its hash: the page's one script and one style, hashed here.
    page = r.text
    script = page.split("<script>", 1)[1].split("</script>", 1)[0]
    style = page.split("<style>", 1)[1].split("</style>", 1)[0]
    assert page.count("<script") == 1 and page.count("<style") == 1

    def sha(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert r.headers["Content-Security-Policy"] == (
        f"default-src 'self'; script-src {sha(script)}; style-src {sha(style)}; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    )
    assert r.headers["Cache-Control"] == "no-store"
    # The page itself holds no data: everything else under /admin/ needs the token.
    assert httpx.get(server.url + "/admin/stats", timeout=10).status_code == 401


# ---- tenant API keys: SHA-256 digests, compared against every key in constant time ---------


KEYED_TENANTS = AdmissionConfig(
    auth=True,
    default_tenant="a",
    tenants=(
        TenantConfig("a", api_keys=("sk-a-1", "sk-a-2")),
        TenantConfig("b", api_keys=("sk-b-1",)),
        TenantConfig("c", api_keys=("sk-c-1", "sk-c-2")),
    ),
)


@pytest.mark.parametrize(
    "given,owner",
    [
        ("sk-a-1", "a"),  # the first key configured
        ("sk-b-1", "b"),  # a middle one
        ("sk-c-2", "c"),  # the last one
        ("sk-b-", None),  # a prefix of a real key
        ("sk-nobody", None),
    ],
)
def test_every_key_is_compared_whatever_the_key(monkeypatch, given, owner):
    registry = TenantRegistry(KEYED_TENANTS)
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", counting)
    tenant = registry.by_api_key(given)
    assert (tenant.name if tenant else None) == owner
    all_keys = [k for t in KEYED_TENANTS.tenants for k in t.api_keys]
    assert len(calls) == len(all_keys) == 5
    # Digests, never the keys: every comparison is of two 32-byte SHA-256 digests, the
    # given key's against each configured key's, each configured key once.
    given_digest = hashlib.sha256(given.encode()).digest()
    assert sorted(stored for stored, _ in calls) == sorted(hashlib.sha256(k.encode()).digest() for k in all_keys)
    assert all(other == given_digest for _, other in calls)
    # With auth on, an unknown key resolves to no tenant (the 401), never the default.
    calls.clear()
    resolved = registry.resolve(given)
    assert (resolved.name if resolved else None) == owner
    assert len(calls) == 5


# ---- the shared prefix cache: a blake2b hash chain over each block's tokens ----------------


def expected_key(parent: bytes | None, tokens: list[int]) -> bytes:
    # The encoding block_key uses: parent key, then the tokens as native int64s.
    return hashlib.blake2b((parent or b"") + struct.pack(f"={len(tokens)}q", *tokens), digest_size=16).digest()


def computed(bm: BlockManager, rid: str, prompt: list[int]) -> Request:
    """A request whose prompt has been allocated, computed and its full blocks cached."""
    request = Request(rid, prompt, SamplingParams(max_tokens=1))
    hits = bm.get_computed_blocks(request)
    assert bm.allocate_slots(request, len(prompt) - len(hits) * bm.block_size, hits) is not None
    request.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(request)
    return request


def test_block_keys_are_a_blake2b_chain_and_never_shared_across_different_tokens():
    a, b, c = [11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34]
    k_a = expected_key(None, a)
    assert block_key(None, a) == k_a and len(k_a) == 16
    assert block_key(k_a, b) == expected_key(k_a, b)
    assert block_key(block_key(k_a, b), c) == expected_key(expected_key(k_a, b), c)
    # The same tokens under another parent, or none, are another key.
    assert len({block_key(None, b), block_key(k_a, b), block_key(block_key(None, c), b)}) == 3
    # Token ids are whole int64s: no two blocks of different ids encode alike.
    assert block_key(None, [1, 256]) != block_key(None, [256, 1]) != block_key(None, [257, 0])

    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = computed(bm, "tenant-1", a + b + c + [99])
    table = bm.block_table("tenant-1")
    chain = [expected_key(None, a)]
    chain += [expected_key(chain[-1], b)]
    chain += [expected_key(chain[-1], c)]
    assert [bm.blocks[i].key for i in table[:3]] == chain
    assert {k: bm.cached[k] for k in chain} == dict(zip(chain, table[:3]))

    # Another request whose first block differs in one token: blocks two and three hold the
    # same tokens as the first request's, yet nothing is shared.
    other = computed(bm, "tenant-2", [11, 12, 13, 15] + b + c + [99])
    other_table = bm.block_table("tenant-2")
    assert other.num_cached_tokens == 0 and not set(other_table) & set(table)
    assert bm.blocks[other_table[1]].key == expected_key(expected_key(None, [11, 12, 13, 15]), b) != chain[1]
    # Blocks in another order are other keys too.
    assert bm.get_computed_blocks(Request("r3", b + a + c + [99], SamplingParams(max_tokens=1))) == []
    # Only the very same prefix finds the cached blocks (the cache works at all).
    assert bm.get_computed_blocks(Request("r4", a + b + [7, 7, 7, 7, 7], SamplingParams(max_tokens=1))) == table[:2]
    bm.free_request(first.request_id)
    bm.free_request(other.request_id)
    bm.check_invariants()


# ---- top_p is validated at the HTTP boundary -----------------------------------------------


BODIES = {
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "top_p,message",
    [
        (0, "top_p: Input should be greater than 0"),
        (-0.5, "top_p: Input should be greater than 0"),
        (1.5, "top_p: Input should be less than or equal to 1"),
        ("x", "top_p: Input should be a valid number"),
    ],
)
def test_out_of_range_top_p_is_400(server, path, top_p, message):
    r = httpx.post(server.url + path, json={**BODIES[path], "top_p": top_p}, timeout=60)
    error = assert_openai_error(r, 400, "invalid_value", "top_p")
    assert error["message"] == message


@pytest.mark.slow
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1])
def test_valid_top_p_is_served(server, path, top_p):
    r = httpx.post(server.url + path, json={**BODIES[path], "top_p": top_p}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1
