"""`headroom predictor calibrate`: run the served model over a prompt set with real
stopping (no ignore_eos) and record how many tokens it actually generates, so the
predictor learns this deployment's model, not ChatGPT's.

Input JSONL rows have `prompt` (a user message) or `messages`, and optionally `id`,
`max_tokens`, `temperature`, `seed`; anything else is carried over. Output rows add
`prompt_tokens` (served tokenizer, chat template applied), `output_tokens` and
`finish_reason`. Rows are appended as they finish; ids already in the output are
skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque

from headroom.contracts.request import SamplingParams
from headroom.prediction.probe_rows import ProbeRecorder
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput


def row_messages(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}]


def calibrate(
    engine: Engine,
    rows: list[dict],
    out_path: str,
    default_max_tokens: int = 512,
    concurrency: int = 64,
    log=sys.stderr,
    recorder: ProbeRecorder | None = None,
) -> int:
    """recorder: also record each sequence's probe features (see probe_rows.py)."""
    if recorder is not None:
        args = engine.loaded.args
        recorder.model_shape = (args.hidden_size, args.num_layers, args.vocab_size)
        engine.watch_hidden(frozenset(recorder.layers), recorder.observe)
    done_ids: set[str] = set()
    if os.path.exists(out_path):
        with open(out_path, encoding="utf-8") as f:
            done_ids = {json.loads(line)["id"] for line in f if line.strip()}
    todo = deque((i, r) for i, r in enumerate(rows) if str(r.get("id", i)) not in done_ids)
    finished: list[tuple[dict, RequestOutput]] = []
    in_flight = 0
    written = 0
    started = time.monotonic()
    with open(out_path, "a", encoding="utf-8") as out:
        while todo or in_flight:
            while todo and in_flight < concurrency:
                i, row = todo.popleft()
                row = {**row, "id": str(row.get("id", i))}
                prompt_ids = engine.tokenizer.apply_chat_template(row_messages(row))
                max_tokens = min(int(row.get("max_tokens", default_max_tokens)), engine.max_model_len - len(prompt_ids))
                if max_tokens < 1:
                    continue
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=float(row.get("temperature", 1.0)), seed=row.get("seed")
                )
                request = engine.new_request(prompt_ids, params)
                row.update(prompt_tokens=len(prompt_ids), max_tokens=max_tokens)
                engine.submit(request, lambda o, row=row: o.finished and finished.append((row, o)))
                in_flight += 1
            engine.step()
            for row, output in finished:
                row.update(output_tokens=output.request.num_output_tokens, finish_reason=output.finish_reason)
                if recorder is not None:
                    recorder.finish(row, output.request, output.finish_reason)
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                in_flight -= 1
                written += 1
            if finished:
                out.flush()
                finished.clear()
                if written % 50 == 0:
                    rate = written / (time.monotonic() - started)
                    print(f"calibrate: {written} done, {len(todo)} to go, {rate:.2f} prompts/s", file=log, flush=True)
    return written
