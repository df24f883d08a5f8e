"""Peak memory and time of loading a model the way `headroom serve` does (prepare_model).

Each load runs in a fresh process, so its peak resident set (the kernel's VmHWM) is the
load's own, and the figure is set against the file's size and what the model holds once
loaded (its tensors' bytes, found by walking the modules).

    python bench/load_memory.py                          # the default model
    python bench/load_memory.py --model ~/.cache/headroom-bench/smollm2-1.7b-random/smollm2-1.7b-random.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def held_bytes(model) -> int:
    """Bytes of every distinct tensor storage the model's modules hold (weights, packed
    copies, tiles), each storage counted once."""
    import torch

    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, (tuple, list)):
            for item in value:
                visit(item)
        elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)):
            for item in vars(value).values():
                visit(item)

    for module in model.modules():
        for item in vars(module).values():
            visit(item)
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            visit(tensor)
    return sum(seen.values())


def load_once(model: str | None, quantization: str) -> dict:
    """In this process: load, and report peak RSS, RSS after, seconds and bytes held."""
    from headroom.config import ModelConfig
    from headroom.executor.device import prepare_model

    before = status_kib("VmRSS")
    start = time.perf_counter()
    loaded, reason = prepare_model(ModelConfig(model=model, quantization=quantization))
    seconds = time.perf_counter() - start
    return {
        "model": model or "default",
        "quantization": loaded.quantization,
        "seconds": round(seconds, 2),
        "rss_before_gib": round(before / 2**20, 3),
        "peak_rss_gib": round(status_kib("VmHWM") / 2**20, 3),
        "rss_after_gib": round(status_kib("VmRSS") / 2**20, 3),
        "held_gib": round(held_bytes(loaded.model) / 2**30, 3),
        "reason": reason,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or HF folder (default: the default model)")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--repeats", type=int, default=1, help="fresh processes, one load each")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child's side
    args = p.parse_args()
    if args.one:
        print(json.dumps(load_once(args.model, args.quantization)))
        return
    from headroom.models.loader import default_model_path

    path = args.model or default_model_path()
    print(f"file: {path} ({os.path.getsize(path) / 2**30:.3f} GiB)" if os.path.isfile(path) else f"folder: {path}")
    command = [sys.executable, __file__, "--one", "--quantization", args.quantization]
    if args.model:
        command += ["--model", args.model]
    for _ in range(args.repeats):
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{result['quantization']}: peak RSS {result['peak_rss_gib']:.2f} GiB, after {result['rss_after_gib']:.2f}"
            f" GiB (held {result['held_gib']:.2f} GiB, before loading {result['rss_before_gib']:.2f}),"
            f" {result['seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
