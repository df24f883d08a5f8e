"""The `headroom` command line: serve (the HTTP API), generate (one completion to the
terminal), predictor (train, eval, calibrate: app/predictor_cli.py) and top (a live view over
the admin API). Settings come from --config FILE (TOML), then flags override them
(flags.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import queue
import sys
from collections.abc import Iterator

from headroom.admin.schemas import SORTS
from headroom.app.flags import add_engine_args, add_server_args, build_config
from headroom.app.predictor_cli import add_predictor_parser
from headroom.config import ConfigError
from headroom.contracts.request import SamplingParams
from headroom.observability.logs import configure_logging
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput


def cmd_serve(ns: argparse.Namespace) -> int:
    from headroom.app.server import serve

    config = build_config(ns)
    configure_logging(config.observability.log_format, ns.log_level)
    engine = Engine.started(config)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, engine))
    else:
        uvloop.run(serve(config, engine))
    return 0


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def logs_after_text() -> Iterator[None]:
    """Log records that arrive while text streams to the terminal, written after it: a
    warning (the loop detector's, say) would otherwise land in the middle of the text."""
    root, held = logging.getLogger(), _Held()
    saved = root.handlers[:]
    root.handlers = [held]
    try:
        yield
    finally:
        root.handlers = saved
        for record in held.records:
            root.handle(record)


def cmd_generate(ns: argparse.Namespace) -> int:
    engine = Engine(build_config(ns))
    tok = engine.tokenizer
    prompt_ids = tok.encode(ns.prompt) if ns.raw else tok.apply_chat_template([{"role": "user", "content": ns.prompt}])
    sampling = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.sample_seed
    )
    try:
        request = engine.new_request(prompt_ids, sampling)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    engine.start()
    engine.submit(request, outputs.put)
    out = None
    with logs_after_text():
        try:
            while out is None or not out.finished:
                out = outputs.get()
                sys.stdout.write(out.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            engine.abort(request.request_id)
        finally:
            engine.stop()
        sys.stdout.write("\n")
        sys.stdout.flush()
    if out is not None and request.first_token_time and request.finished_time:
        decode_s = max(request.finished_time - request.first_token_time, 1e-9)
        print(
            f"[{request.num_output_tokens} tokens, finish_reason={out.finish_reason}, "
            f"{(request.num_output_tokens - 1) / decode_s:.1f} tokens/s decode]",
            file=sys.stderr,
        )
    return 0


def cmd_top(ns: argparse.Namespace) -> int:
    from headroom.admin import top

    return top.main(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headroom", description="headroom LLM inference server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_server_args(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="stream one completion from the model to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    add_predictor_parser(sub)

    top = sub.add_parser("top", help="live terminal view of the costliest sequences (admin API)")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    top.add_argument("--token", default=None, help="admin bearer token (default: $HEADROOM_ADMIN_TOKEN)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--sort", choices=SORTS, default="cost")
    top.add_argument(
        "--once", action="store_true", help="print the view once and exit (what it does where stdout is no terminal)"
    )
    top.set_defaults(func=cmd_top)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"headroom: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
