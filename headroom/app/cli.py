"""The `headroom` command line: generate (stream one completion to the terminal)."""

from __future__ import annotations

import argparse
import logging
import queue
import sys

from headroom.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from headroom.runtime.engine import Engine, RequestOutput
from headroom.runtime.request import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--attention-backend", default="auto", help="auto, torch, flash_attn, xformers")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--seed", type=int, default=0)


def config_from_args(ns: argparse.Namespace) -> Config:
    return Config(
        model=ModelConfig(
            model=ns.model,
            served_model_name=ns.served_model_name,
            dtype=ns.dtype,
            device=ns.device,
            max_model_len=ns.max_model_len,
        ),
        cache=CacheConfig(
            block_size=ns.block_size,
            num_blocks=ns.num_kv_blocks,
            kv_cache_memory_gib=ns.kv_cache_memory_gib,
            enable_prefix_caching=not ns.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            enable_chunked_prefill=not ns.no_chunked_prefill,
        ),
        attention_backend=ns.attention_backend,
        seed=ns.seed,
    )


def cmd_generate(ns: argparse.Namespace) -> int:
    engine = Engine(config_from_args(ns))
    tok = engine.tokenizer
    if ns.raw:
        prompt_ids = tok.encode(ns.prompt)
    else:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": ns.prompt}])
    sampling = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed_request
    )
    try:
        request = engine.new_request(prompt_ids, sampling)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    engine.start()
    engine.submit(request, outputs.put)
    try:
        while True:
            out = outputs.get()
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished:
                break
    except KeyboardInterrupt:
        engine.abort(request.request_id)
    finally:
        engine.stop()
    sys.stdout.write("\n")
    print(
        f"[{request.num_output_tokens} tokens, finish_reason={out.finish_reason}, "
        f"{request.num_output_tokens / max(request.finished_time - request.first_token_time, 1e-9):.1f} tokens/s decode]"
        if request.finished_time and request.first_token_time else "",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headroom", description="headroom LLM inference server")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion from the model to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
