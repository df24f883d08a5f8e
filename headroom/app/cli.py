"""The `headroom` command line: serve (the HTTP API), generate (one completion to the
terminal), predictor (train, eval, calibrate) and top (a live view over the admin API).
Settings come from --config FILE (TOML), then flags override them."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import queue
import sys
import tomllib

from headroom.config import (
    AdminConfig,
    AdmissionConfig,
    CacheConfig,
    Config,
    ConfigError,
    ModelConfig,
    ObservabilityConfig,
    PoolsConfig,
    SchedulerConfig,
    ServerConfig,
)
from headroom.observability.logs import configure_logging
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput
from headroom.runtime.request import SamplingParams

# flag dest -> (config section, field)
_FLAGS = {
    "model": ("model", "model"),
    "served_model_name": ("model", "served_model_name"),
    "dtype": ("model", "dtype"),
    "quantization": ("model", "quantization"),
    "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"),
    "enforce_eager": ("model", "enforce_eager"),
    "block_size": ("cache", "block_size"),
    "num_kv_blocks": ("cache", "num_blocks"),
    "kv_cache_memory_gib": ("cache", "kv_cache_memory_gib"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"),
    "prefix_caching": ("cache", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "chunked_prefill": ("scheduler", "enable_chunked_prefill"),
    "host": ("server", "host"),
    "port": ("server", "port"),
    "max_body_bytes": ("server", "max_body_bytes"),
    "max_queue_len": ("server", "max_queue_len"),
    "drain_timeout": ("server", "drain_timeout_s"),
    "unknown_fields": ("server", "unknown_fields"),
    "request_metrics": ("server", "request_metrics"),
    "attention_backend": (None, "attention_backend"),
    "seed": (None, "seed"),
    "admission": ("admission", "enabled"),
    "log_format": ("observability", "log_format"),
    "log_prompts": ("observability", "log_prompts"),
}
_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
    "admission": AdmissionConfig,
    "pools": PoolsConfig,
    "observability": ObservabilityConfig,
    "admin": AdminConfig,
}


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")
    return value == "on"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (flags override --config)")
    g.add_argument("--config", default=None, help="TOML file with [model] [cache] [scheduler] [server] tables")
    g.add_argument("--model", help="GGUF file or HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        help="weight-only quantised linears on the CPU (auto: int4 for a float32 model on the CPU)",
    )
    g.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--attention-backend", help="auto, torch, triton, flash_attn, xformers")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="on CUDA, run decode eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument("--block-size", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--kv-cache-memory-gib", type=float)
    g.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the KV cache's dtype (auto: float16 beside quantised CPU weights, else the model's)",
    )
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--seed", type=int)


def build_config(ns: argparse.Namespace) -> Config:
    tables: dict = {}
    if ns.config:
        with open(ns.config, "rb") as f:
            tables = tomllib.load(f)
    sections = {name: dict(tables.get(name, {})) for name in _SECTIONS}
    top = {k: v for k, v in tables.items() if k not in _SECTIONS}
    for dest, (section, name) in _FLAGS.items():
        value = getattr(ns, dest, None)
        if value is not None:
            (sections[section] if section else top)[name] = value
    try:
        built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
        return Config(**built, **top)
    except TypeError as exc:  # an unknown key in the file
        raise ConfigError(f"config: {exc}") from None


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
    if out is not None and request.first_token_time and request.finished_time:
        decode_s = max(request.finished_time - request.first_token_time, 1e-9)
        print(
            f"[{request.num_output_tokens} tokens, finish_reason={out.finish_reason}, "
            f"{(request.num_output_tokens - 1) / decode_s:.1f} tokens/s decode]",
            file=sys.stderr,
        )
    return 0


def cmd_predictor_calibrate(ns: argparse.Namespace) -> int:
    from headroom.admission.calibrate import calibrate

    with open(ns.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if ns.limit:
        rows = rows[: ns.limit]
    config = build_config(ns)
    # The labels are the model's own ends: no loop policy may cut a run short.
    engine = Engine(
        dataclasses.replace(
            config,
            scheduler=dataclasses.replace(config.scheduler, max_num_seqs=ns.concurrency),
            admin=dataclasses.replace(config.admin, loop_policy="off"),
        )
    )
    recorder = None
    if ns.probe_layers:
        from headroom.admission.inflight import InflightRecorder

        recorder = InflightRecorder(tuple(int(x) for x in ns.probe_layers.split(",")))
    n = calibrate(engine, rows, ns.out, default_max_tokens=ns.max_tokens, concurrency=ns.concurrency, recorder=recorder)
    print(f"calibrate: wrote {n} records to {ns.out}", file=sys.stderr)
    if recorder is not None:
        recorder.save(ns.features)
        print(f"calibrate: wrote {len(recorder.rows)} in-flight rows to {ns.features}", file=sys.stderr)
    return 0


def cmd_predictor_train(ns: argparse.Namespace) -> int:
    from headroom.admission.train import format_metrics, load_records, train

    if ns.inflight:
        return _train_inflight(ns)
    if not ns.data:
        print("headroom: predictor train needs --data or --inflight", file=sys.stderr)
        return 2
    try:
        metrics = train(load_records(ns.data), ns.out, seed=ns.seed)
    except ValueError as exc:  # too few records
        print(f"headroom: {exc}", file=sys.stderr)
        return 2
    print(format_metrics(metrics))
    print(f"\npredictor saved to {ns.out}", file=sys.stderr)
    return 0


def cmd_predictor_eval(ns: argparse.Namespace) -> int:
    from headroom.admission.predictor import load_predictor
    from headroom.admission.train import evaluate, format_metrics, load_records

    if ns.inflight:
        return _eval_inflight(ns.inflight, ns.probe)
    if not ns.data:
        print("headroom: predictor eval needs --data or --inflight", file=sys.stderr)
        return 2
    records = load_records(ns.data)
    if ns.cv:
        from headroom.admission.train import cross_validate, format_cv

        try:
            print(format_cv(cross_validate(records, ns.cv)))
        except ValueError as exc:  # too few records
            print(f"headroom: {exc}", file=sys.stderr)
            return 2
        return 0
    if not ns.all_rows and any(r.get("split") == "test" for r in records):
        records = [r for r in records if r.get("split") == "test"]
    try:
        predictor = load_predictor(ns.predictor)
    except ValueError as exc:  # trained for another feature version
        print(f"headroom: {exc}", file=sys.stderr)
        return 2
    print(format_metrics(evaluate(predictor, records)))
    return 0


def _load_rows(path: str) -> dict:
    import numpy as np

    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _train_inflight(ns: argparse.Namespace) -> int:
    from headroom.admission.inflight import PCA_DIMS, evaluate, format_scores
    from headroom.admission.inflight_model import InflightProbe

    data = _load_rows(ns.inflight)
    layers = [int(x) for x in data["layers"]]
    layer = ns.layer if ns.layer is not None else layers[0]
    if layer not in layers:
        print(f"headroom: {ns.inflight} has layers {layers}, not {layer}", file=sys.stderr)
        return 2
    print(
        format_scores(
            f"layer {layer} (PCA {PCA_DIMS}) and loop signals, 4-fold CV by request",
            evaluate(data, layer, seed=ns.seed),
        )
    )
    InflightProbe.train(data, layer, seed=ns.seed).save(ns.out)
    print(f"\nin-flight probe (all {len(data['ids'])} rows) saved to {ns.out}", file=sys.stderr)
    return 0


def _eval_inflight(path: str, probe_dir: str | None) -> int:
    from headroom.admission.inflight import PCA_DIMS, evaluate, format_scores

    data = _load_rows(path)
    if probe_dir is not None:
        from headroom.admission.inflight import score
        from headroom.admission.inflight_model import InflightProbe

        probe = InflightProbe.load(probe_dir)
        p_cap, p_remaining = probe.predict_rows(data)
        print(
            format_scores(
                f"the probe in {probe_dir} (layer {probe.layer}) on every row of {path}",
                score(data, p_cap, p_remaining),
            )
        )
        return 0
    print(format_scores("prompt and length features only (4-fold CV by request)", evaluate(data, None)))
    for layer in data["layers"]:
        print()
        print(
            format_scores(
                f"+ layer {layer}'s residual stream (PCA {PCA_DIMS}) and loop signals", evaluate(data, int(layer))
            )
        )
    return 0


def cmd_top(ns: argparse.Namespace) -> int:
    from headroom.admin import top

    return top.main(ns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headroom", description="headroom LLM inference server")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    srv.add_argument("--host")
    srv.add_argument("--port", type=int)
    srv.add_argument("--max-body-bytes", type=int)
    srv.add_argument("--max-queue-len", type=int)
    srv.add_argument("--drain-timeout", type=float, help="seconds streams may run on after SIGTERM")
    srv.add_argument(
        "--unknown-fields",
        choices=["reject", "accept"],
        help="a request field no schema knows: 400 naming it (reject, as OpenAI) "
        "or ignored with a warning (accept, as vLLM)",
    )
    srv.add_argument(
        "--request-metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a metrics object (waits, TTFT, engine seconds ...) on final responses",
    )
    srv.add_argument("--admission", type=_on_off, metavar="on|off", help="per-tenant admission control")
    srv.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        help="log lines as JSON (default when not a terminal) or for a human",
    )
    srv.add_argument(
        "--log-prompts",
        action="store_true",
        default=None,
        help="put prompt messages into the per-request log line (off: prompts can hold secrets)",
    )
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

    pred = sub.add_parser("predictor", help="train, evaluate and calibrate the output-length predictor")
    pred_sub = pred.add_subparsers(dest="predictor_command", required=True)
    cal = pred_sub.add_parser("calibrate", help="label prompts with the served model's real output lengths")
    cal.add_argument("--prompts", required=True, help="JSONL with prompt or messages (+ max_tokens, temperature, seed)")
    cal.add_argument("--out", required=True, help="JSONL to append labelled records to")
    cal.add_argument("--max-tokens", type=int, default=512, help="cap for rows without their own max_tokens")
    cal.add_argument("--concurrency", type=int, default=64)
    cal.add_argument("--limit", type=int, default=None)
    cal.add_argument(
        "--probe-layers", default=None, help="comma-separated decoder layers whose last-token state to record in flight"
    )
    cal.add_argument("--features", default="inflight.npz", help="where --probe-layers' rows go (.npz)")
    add_engine_args(cal)
    cal.set_defaults(func=cmd_predictor_calibrate)
    trn = pred_sub.add_parser("train", help="fit the predictor on calibration records; print held-out metrics")
    trn.add_argument("--data", default=None, help="calibration JSONL (split=train rows fit, split=test rows score)")
    trn.add_argument(
        "--inflight",
        default=None,
        help="in-flight rows from `calibrate --probe-layers`: train the in-flight probe instead",
    )
    trn.add_argument("--layer", type=int, default=None, help="with --inflight: the probe layer (default: the first)")
    trn.add_argument("--out", required=True, help="directory for the model files and meta.json")
    trn.add_argument("--seed", type=int, default=0)
    trn.set_defaults(func=cmd_predictor_train)
    evl = pred_sub.add_parser("eval", help="score a trained predictor on calibration records")
    evl.add_argument("--data", default=None, help="calibration JSONL; only split=test rows when it has any")
    evl.add_argument(
        "--inflight",
        default=None,
        help="in-flight rows from `calibrate --probe-layers`: AUC and tau by generated tokens",
    )
    evl.add_argument("--predictor", default=None, help="model directory (default: the packaged one)")
    evl.add_argument(
        "--probe", default=None, help="with --inflight: score this trained in-flight probe on the rows (held-out rows)"
    )
    evl.add_argument("--all-rows", action="store_true", help="score every row, not only split=test")
    evl.add_argument(
        "--cv",
        type=int,
        default=None,
        metavar="K",
        help="with --data: K-fold CV of the prompt-only predictor over every row (refitted per fold)",
    )
    evl.set_defaults(func=cmd_predictor_eval)

    top = sub.add_parser("top", help="live terminal view of the costliest sequences (admin API)")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    top.add_argument("--token", default=None, help="admin bearer token (default: $HEADROOM_ADMIN_TOKEN)")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--sort", choices=["cost", "kv_blocks", "age", "output_tokens", "progress"], default="cost")
    top.set_defaults(func=cmd_top)

    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"headroom: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
