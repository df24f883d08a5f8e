"""The data behind the loop detector's defaults ([admin] loop_*): the default model's own
greedy outputs on the calibration prompts, and what each detector setting would do to them.

Generates (in-process, temperature 0, max_tokens 512, the chat template, the server's
engine with the loop policy off) the outputs of every prompt of
data/calibration/smollm2-135m-labels.jsonl labelled at temperature 0 with a prompt under
600 tokens, of the `train` split (where the setting is chosen) and the `test` split (where
it is checked), or reads them back from --cache. Then, for each setting, replays every
output through `first_detection` and prints, per split:

  caught     runs to the 512-token cap that the policy would have ended early
  saved      the share of those runs' tokens it would not have generated
  truncated  sequences that ended on their own which the policy would have cut
             (with `stop`, when the detector fires before their end; with `cap`,
             when their end is more than cap_tokens after it fires)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hol import PROMPTS, cpu_line

from headroom.config import AdminConfig, Config
from headroom.contracts.repetition import RepetitionDetection, first_detection

MAX_TOKENS = 512


def generate(split: str) -> list[dict]:
    from headroom.contracts.request import SamplingParams
    from headroom.runtime.engine import Engine

    rows = [json.loads(line) for line in (PROMPTS.parent / "smollm2-135m-labels.jsonl").open(encoding="utf-8")]
    rows = [r for r in rows if r["split"] == split and r["temperature"] == 0.0 and r["prompt_tokens"] < 600]
    engine = Engine(Config(admin=AdminConfig(loop_policy="off")))
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in rows]
    done = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    return [{"id": r["id"], "finish": q.status.finish_reason, "out": q.output_token_ids} for r, q in zip(rows, done)]


def evaluate(rows: list[dict], detection: RepetitionDetection, cap_tokens: int) -> tuple[int, int, float, int, int]:
    capped = [r for r in rows if r["finish"] == "length"]
    ended = [r for r in rows if r["finish"] == "stop"]
    fired = [first_detection(r["out"], detection) for r in capped]
    caught = sum(1 for f in fired if f and f[0] + cap_tokens < MAX_TOKENS)
    saved = sum(max(0, MAX_TOKENS - f[0] - cap_tokens) for f in fired if f) / sum(len(r["out"]) for r in capped)
    truncated = 0
    for r in ended:
        f = first_detection(r["out"], detection)
        truncated += bool(f and f[0] + cap_tokens < len(r["out"]))
    return caught, len(capped), saved, truncated, len(ended)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", default=None, help="a directory for the generated outputs (read back if present)")
    args = p.parse_args()
    print(cpu_line())
    splits = {}
    for split in ("train", "test"):
        path = Path(args.cache) / f"loop_outputs_{split}.jsonl" if args.cache else None
        if path is not None and path.exists():
            splits[split] = [json.loads(line) for line in path.open(encoding="utf-8")]
            continue
        splits[split] = generate(split)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in splits[split]), encoding="utf-8")
    for split, rows in splits.items():
        print(f"# {split}: {len(rows)} prompts, {sum(r['finish'] == 'length' for r in rows)} ran to the cap")
    default = AdminConfig()
    settings = sorted(
        {
            (default.loop_max_pattern_size, default.loop_min_pattern_size, default.loop_min_count),
            *itertools.product((32, 64, 128), (1, 4, 8), (3, 4, 5)),
        }
    )
    print("max min count | policy | " + " | ".join(f"{s}: caught, saved, truncated" for s in splits))
    for setting in settings:
        detection = RepetitionDetection(*setting)
        for policy, cap_tokens in (("stop", 0), ("cap", default.cap_tokens)):
            cells = []
            for rows in splits.values():
                caught, capped, saved, truncated, ended = evaluate(rows, detection, cap_tokens)
                cells.append(f"{caught}/{capped}, {saved:.0%}, {truncated}/{ended}")
            mark = (
                " (default)"
                if setting == (default.loop_max_pattern_size, default.loop_min_pattern_size, default.loop_min_count)
                and policy == default.loop_policy
                else ""
            )
            print(f"{setting[0]:3d} {setting[1]:3d} {setting[2]:5d} | {policy}{mark} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
