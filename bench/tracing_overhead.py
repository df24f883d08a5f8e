"""Tokens/s with tracing on (exporting to a live OTLP/gRPC receiver) versus off, in one
process, on the same engine.

The receiver is a separate process (a collector never shares the server's CPU budget
in production, and here it must not share its GIL). Runs alternate off/on --repeats
times at --concurrency streaming requests; the medians are compared. Every span the
server made must reach the receiver.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

import aiohttp
import torch

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from headroom.runtime.engine import Engine

SPANS_PER_SEQUENCE = 5  # the request span + admission, queue, prefill, decode


def receive() -> None:
    """The receiver process: print the port, count spans until stdin closes, print the count."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = 0

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            nonlocal count
            count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(1)
    print(count, flush=True)


async def load(url: str, prompts: list[list[int]], output_len: int) -> float:
    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for _ in r.content:
                pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        return len(prompts) * output_len / (time.perf_counter() - started)


def run(config: Config, engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """tokens/s, and spans dropped (0 when tracing is off)."""
    server = BackgroundServer(config, engine).start()
    try:
        tok_s = asyncio.run(load(server.url, prompts, output_len))
    finally:
        server.stop()  # flushes the spans
    return tok_s, server.app[keys.OBSERVABILITY].tracing.dropped_spans()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.receive:
        return receive()

    receiver = subprocess.Popen(
        [sys.executable, __file__, "--receive"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    port = int(receiver.stdout.readline())
    config = Config(
        model=ModelConfig(dtype=ns.dtype),
        cache=CacheConfig(kv_cache_memory_gib=1.0, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=ns.concurrency, max_num_batched_tokens=512),
    )
    engine = Engine(config)
    rng = random.Random(0)
    vocab = engine.loaded.args.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(ns.prompt_len)] for _ in range(ns.concurrency)]

    print(
        f"# tracing_overhead: model={engine.loaded.name} dtype={engine.executor.dtype} "
        f"threads={torch.get_num_threads()} "
        f"concurrency={ns.concurrency} prompt={ns.prompt_len} output={ns.output_len} exporter=otlp/grpc"
    )
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    off, on = [], []
    traced_requests = dropped = 0
    run(config, engine, prompts()[:4], 4)  # warm-up
    for i in range(ns.repeats):
        for name in endpoint:
            os.environ.pop(name, None)
        off.append(run(config, engine, prompts(), ns.output_len)[0])
        os.environ.update(endpoint)
        tok_s, lost = run(config, engine, prompts(), ns.output_len)
        on.append(tok_s)
        dropped += lost
        traced_requests += ns.concurrency
        print(f"run {i}: tracing off {off[-1]:.1f} tok/s, on {on[-1]:.1f} tok/s", flush=True)
    receiver.stdin.close()
    received = int(receiver.stdout.readline())
    receiver.wait(10)
    o, t = statistics.median(off), statistics.median(on)
    print(f"tracing off: {o:.1f} tok/s (median of {ns.repeats})")
    print(f"tracing on:  {t:.1f} tok/s (median of {ns.repeats})")
    print(f"ratio on/off: {t / o:.3f}  (overhead {100 * (1 - t / o):.1f}%, target < 3%)")
    print(f"spans received: {received} of {traced_requests * SPANS_PER_SEQUENCE} expected; dropped: {dropped}")


if __name__ == "__main__":
    main()
