"""One-off: draw the calibration prompt set from ShareGPT (see headroom/prediction/data/README.md).

Reads ../shared/data/sharegpt_pairs_with_text.jsonl.gz (not needed at run time), keeps
first-turn prompts of at most 1,024 cl100k tokens, draws a seeded sample per split, and
gives each prompt the decoding settings users send: temperature from {0, 0.7, 1.0} and a
max_tokens cap from {128, 256, 512}. Writes JSONL: id, split, prompt, temperature,
max_tokens, seed, chatgpt_output_tokens (a secondary signal only). `--exclude` skips
conversations already drawn into an earlier file, so a second draw extends the set.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--src", default="../shared/data/sharegpt_pairs_with_text.jsonl.gz")
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=1600)
    p.add_argument("--test", type=int, default=400)
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--exclude", action="append", default=[], help="JSONL whose ids to skip")
    ns = p.parse_args()
    rng = random.Random(ns.seed)
    excluded: set[str] = set()
    for path in ns.exclude:
        with open(path, encoding="utf-8") as f:
            excluded |= {json.loads(line)["id"].rsplit("_", 1)[0] for line in f if line.strip()}
    by_split: dict[str, list[dict]] = {"train": [], "test": []}
    with gzip.open(ns.src, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if (
                row["split"] in by_split
                and row["turn"] == 0
                and 0 < int(row["prompt_tokens"]) <= 1024
                and row["conv_id"] not in excluded
            ):
                by_split[row["split"]].append(row)
    with open(ns.out, "w", encoding="utf-8") as out:
        for split, n in (("train", ns.train), ("test", ns.test)):
            for row in rng.sample(by_split[split], n):
                record = {
                    "id": row["id"],
                    "split": split,
                    "prompt": row["prompt"],
                    "temperature": rng.choice([0.0, 0.7, 1.0]),
                    "max_tokens": rng.choice([128, 256, 512]),
                    "seed": rng.randrange(2**31),
                    "chatgpt_output_tokens": int(row["output_tokens"]),
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
