"""What structured outputs cost.

1. Grammar compile time, in process (xgrammar, this model's tokenizer): a cold compile of
   schemas of growing size, and the same spec again (the cache).
2. A real `headroom serve` (defaults) on 127.0.0.1: output tok/s with a JSON schema
   against without, at concurrency 1 and 32 (chat, temperature 0, max_tokens 128; the
   unconstrained requests run to max_tokens with ignore_eos, the constrained ones end
   where their JSON does, so tok/s is output tokens over wall time for both).
3. Whether compiling stalls anyone: the largest gap between tokens of a plain stream
   while --compiles requests with distinct, never-seen schemas arrive, against the same
   stream alone.

    python bench/structured.py [--requests 64] [--compiles 16]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from headroom.executor.grammar import Grammars, GrammarSpec
from headroom.models.loader import default_model_path
from headroom.models.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import cpu_line, free_port, start_server, stop_server

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": ITEM, "minItems": 3, "maxItems": 6}},
    "required": ["people"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "List some people with their name, age and city, as JSON."}]


def wide_schema(fields: int, salt: int = 0) -> dict:
    """An object of `fields` typed properties: a bigger grammar to compile."""
    kinds = [
        {"type": "string", "maxLength": 20},
        {"type": "integer"},
        {"type": "boolean"},
        {"type": "string", "enum": ["a", "b", "c"]},
        {"type": "array", "items": {"type": "number"}},
    ]
    props = {f"f{salt}_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def compile_times() -> None:
    tokenizer = Tokenizer.from_gguf(default_model_path())
    grammars = Grammars(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids)
    print(f"{'grammar':<34}{'cold ms':>10}{'cached ms':>11}")
    specs = [
        ("any JSON (json_object)", GrammarSpec("json")),
        ("people (nested array)", GrammarSpec.json_schema(PEOPLE)),
    ]
    specs += [(f"object of {n} fields", GrammarSpec.json_schema(wide_schema(n))) for n in (10, 50, 200)]
    specs += [("regex: phone number", GrammarSpec("regex", r"\(\d{3}\) \d{3}-\d{4}"))]
    for label, spec in specs:
        t0 = time.perf_counter()
        grammars.compile(spec)
        t1 = time.perf_counter()
        grammars.compile(spec)
        t2 = time.perf_counter()
        print(f"{label:<34}{(t1 - t0) * 1e3:>10.1f}{(t2 - t1) * 1e3:>11.3f}")


async def one(
    session: aiohttp.ClientSession, url: str, schema: dict | None, max_tokens: int = 128
) -> tuple[int, list[float]]:
    body = {
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    stamps, tokens = [], 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.monotonic())
    return tokens, stamps


async def throughput(url: str, schema: dict | None, concurrency: int, requests: int) -> tuple[float, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await one(session, url, schema)  # warm: the compile, the first shapes
        queue = list(range(requests))
        counts: list[int] = []

        async def worker() -> None:
            while queue:
                queue.pop()
                tokens, _ = await one(session, url, schema)
                counts.append(tokens)

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return sum(counts) / (time.monotonic() - t0), statistics.mean(counts)


async def stall(url: str, compiles: int) -> tuple[float, float]:
    """Largest token gap of a plain stream while `compiles` schema requests arrive: with a
    schema the server has compiled before, then with as many it has never seen."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await one(session, url, wide_schema(200), 4)

        async def run(schemas: list[dict]) -> float:
            plain = asyncio.create_task(one(session, url, None))
            await asyncio.sleep(0.3)
            await asyncio.gather(*(one(session, url, schema, 4) for schema in schemas))
            _, stamps = await plain
            return max(b - a for a, b in itertools.pairwise(stamps))

        cached = await run([wide_schema(200)] * compiles)
        cold = await run([wide_schema(200, salt=k + 1) for k in range(compiles)])
    return cached, cold


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency-32 run")
    p.add_argument("--compiles", type=int, default=16)
    ns = p.parse_args()
    print(cpu_line())
    print("\n1. compile time")
    compile_times()

    port = free_port()
    proc = start_server(port, "auto", None, admission=True)
    url = f"http://127.0.0.1:{port}"
    try:
        print("\n2. tok/s, `headroom serve` defaults")
        print(f"{'concurrency':<14}{'plain tok/s':>12}{'schema tok/s':>14}{'ratio':>8}{'schema tokens/req':>19}")
        for concurrency, requests in ((1, 8), (32, ns.requests)):
            plain, _ = asyncio.run(throughput(url, None, concurrency, requests))
            constrained, mean_tokens = asyncio.run(throughput(url, PEOPLE, concurrency, requests))
            print(f"{concurrency:<14}{plain:>12.1f}{constrained:>14.1f}{constrained / plain:>8.3f}{mean_tokens:>19.1f}")
        print(
            f"\n3. largest gap between tokens of a plain stream while {ns.compiles} requests with a "
            "200-field schema arrive"
        )
        cached, cold = asyncio.run(stall(url, ns.compiles))
        print(
            f"schema compiled before: {cached * 1e3:.0f} ms; {ns.compiles} never-seen schemas, each compiled "
            f"then: {cold * 1e3:.0f} ms"
        )
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
