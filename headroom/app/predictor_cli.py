"""`headroom predictor`: the output-length predictor's offline tooling, apart from serving.
calibrate labels prompts with the served model's real output lengths (and, with
--probe-layers, records the length probe's rows); train fits the predictor or the
length probe; eval scores either on held-out rows."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from headroom.app.flags import add_engine_args, build_config
from headroom.config import SpeculativeConfig
from headroom.runtime.engine import Engine


def cmd_predictor_calibrate(ns: argparse.Namespace) -> int:
    from headroom.prediction.calibrate import calibrate

    with open(ns.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if ns.limit:
        rows = rows[: ns.limit]
    config = build_config(ns)
    # The labels are the model's own ends: no loop policy may cut a run short. One token a
    # step: the probe's rows are recorded at exact token counts, which kept guesses skip.
    engine = Engine(
        dataclasses.replace(
            config,
            scheduler=dataclasses.replace(config.scheduler, max_num_seqs=ns.concurrency),
            admin=dataclasses.replace(config.admin, loop_policy="off"),
            speculative=SpeculativeConfig(method="off"),
        )
    )
    recorder = None
    if ns.probe_layers:
        from headroom.prediction.probe_rows import ProbeRecorder

        recorder = ProbeRecorder(tuple(int(x) for x in ns.probe_layers.split(",")))
    n = calibrate(engine, rows, ns.out, default_max_tokens=ns.max_tokens, concurrency=ns.concurrency, recorder=recorder)
    print(f"calibrate: wrote {n} records to {ns.out}", file=sys.stderr)
    if recorder is not None:
        recorder.save(ns.features)
        print(f"calibrate: wrote {len(recorder.rows)} probe rows to {ns.features}", file=sys.stderr)
    return 0


def cmd_predictor_train(ns: argparse.Namespace) -> int:
    from headroom.prediction.train import format_metrics, load_records, train

    if ns.probe_rows:
        return _train_probe(ns)
    if not ns.data:
        print("headroom: predictor train needs --data or --probe-rows", file=sys.stderr)
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
    from headroom.prediction.predictor import load_predictor
    from headroom.prediction.train import evaluate, format_metrics, load_records

    if ns.probe_rows:
        return _eval_probe(ns.probe_rows, ns.probe)
    if not ns.data:
        print("headroom: predictor eval needs --data or --probe-rows", file=sys.stderr)
        return 2
    records = load_records(ns.data)
    if ns.cv:
        from headroom.prediction.train import cross_validate, format_cv

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


def _train_probe(ns: argparse.Namespace) -> int:
    from headroom.prediction.probe_model import ProbeModel
    from headroom.prediction.probe_rows import PCA_DIMS, evaluate, format_scores

    data = _load_rows(ns.probe_rows)
    layers = [int(x) for x in data["layers"]]
    layer = ns.layer if ns.layer is not None else layers[0]
    if layer not in layers:
        print(f"headroom: {ns.probe_rows} has layers {layers}, not {layer}", file=sys.stderr)
        return 2
    print(
        format_scores(
            f"layer {layer} (PCA {PCA_DIMS}) and loop signals, 4-fold CV by request",
            evaluate(data, layer, seed=ns.seed),
        )
    )
    ProbeModel.train(data, layer, seed=ns.seed).save(ns.out)
    print(f"\nlength probe (all {len(data['ids'])} rows) saved to {ns.out}", file=sys.stderr)
    return 0


def _eval_probe(path: str, probe_dir: str | None) -> int:
    from headroom.prediction.probe_rows import PCA_DIMS, evaluate, format_scores

    data = _load_rows(path)
    if probe_dir is not None:
        from headroom.prediction.probe_model import ProbeModel
        from headroom.prediction.probe_rows import score

        probe = ProbeModel.load(probe_dir)
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


def add_predictor_parser(sub: argparse._SubParsersAction) -> None:
    pred = sub.add_parser("predictor", help="train, evaluate and calibrate the output-length predictor")
    pred_sub = pred.add_subparsers(dest="predictor_command", required=True)
    cal = pred_sub.add_parser("calibrate", help="label prompts with the served model's real output lengths")
    cal.add_argument("--prompts", required=True, help="JSONL with prompt or messages (+ max_tokens, temperature, seed)")
    cal.add_argument("--out", required=True, help="JSONL to append labelled records to")
    cal.add_argument("--max-tokens", type=int, default=512, help="cap for rows without their own max_tokens")
    cal.add_argument("--concurrency", type=int, default=64)
    cal.add_argument("--limit", type=int, default=None)
    cal.add_argument(
        "--probe-layers",
        default=None,
        help="comma-separated decoder layers whose last-token state to record as sequences run",
    )
    cal.add_argument("--features", default="probe_rows.npz", help="where --probe-layers' rows go (.npz)")
    add_engine_args(cal)
    cal.set_defaults(func=cmd_predictor_calibrate)
    trn = pred_sub.add_parser("train", help="fit the predictor on calibration records; print held-out metrics")
    trn.add_argument("--data", default=None, help="calibration JSONL (split=train rows fit, split=test rows score)")
    trn.add_argument(
        "--probe-rows",
        "--inflight",  # its old name
        default=None,
        help="probe rows from `calibrate --probe-layers`: train the length probe instead",
    )
    trn.add_argument("--layer", type=int, default=None, help="with --probe-rows: the probe layer (default: the first)")
    trn.add_argument("--out", required=True, help="directory for the model files and meta.json")
    trn.add_argument("--seed", type=int, default=0)
    trn.set_defaults(func=cmd_predictor_train)
    evl = pred_sub.add_parser("eval", help="score a trained predictor on calibration records")
    evl.add_argument("--data", default=None, help="calibration JSONL; only split=test rows when it has any")
    evl.add_argument(
        "--probe-rows",
        "--inflight",  # its old name
        default=None,
        help="probe rows from `calibrate --probe-layers`: AUC and tau by generated tokens",
    )
    evl.add_argument("--predictor", default=None, help="model directory (default: the packaged one)")
    evl.add_argument(
        "--probe", default=None, help="with --probe-rows: score this trained probe on the rows (held-out rows)"
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
