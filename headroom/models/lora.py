"""LoRA adapters in PEFT's format, applied to the rows of a mixed batch.

An adapter is read from a PEFT folder (adapter_config.json + adapter_model.safetensors)
and laid out for the model's fused projections: per layer and per projection (qkv, o,
gate_up, down), one A that stacks the A of every targeted part, and one B as wide as the
fused output with each part's B in its own block (zeros elsewhere), PEFT's scaling
folded in. A step's rows are grouped by adapter (Punica's SGMV shape): each group is
gathered once, shrunk through A, expanded through B and added to the projection's output,
so base rows cost nothing and an adapter costs two small matmuls per projection.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from headroom.contracts.request import AdapterRef
from headroom.models.llama import ModelArgs

PROJECTIONS = ("qkv", "o", "gate_up", "down")
# PEFT's module name -> (fused projection, part index within it).
PARTS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
WEIGHT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
# The block each module sits in, as in the checkpoint: `self_attn.q_proj`, `mlp.down_proj`.
BLOCKS = {module: "self_attn" if fused in ("qkv", "o") else "mlp" for module, (fused, _) in PARTS.items()}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraError(ValueError):
    """An adapter that cannot be served, in words that name the file and the fault."""


class LoraInUse(LoraError):
    """An unload refused: sequences still run under the adapter."""


def part_shapes(args: ModelArgs) -> dict[str, tuple[list[int], int]]:
    """Per fused projection: the output sizes of its parts, and its input size."""
    q, kv, h, i = (
        args.num_heads * args.head_dim,
        args.num_kv_heads * args.head_dim,
        args.hidden_size,
        args.intermediate_size,
    )
    return {"qkv": ([q, kv, kv], h), "o": ([h], q), "gate_up": ([i, i], h), "down": ([h], i)}


def base_linear_parameters(args: ModelArgs) -> int:
    """The weights of the decoder's linears, which a token multiplies once each."""
    per_layer = sum(sum(outs) * fan_in for outs, fan_in in part_shapes(args).values())
    return args.num_layers * per_layer


@dataclass
class FusedLora:
    """One fused projection's delta: out += (x @ a.T) @ b.T."""

    a: torch.Tensor  # (R, in): the targeted parts' A stacked
    b: torch.Tensor  # (out, R): each part's B * scaling in its block, zeros elsewhere

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.t()) @ self.b.t()


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    targets: tuple[str, ...]  # PEFT module names, e.g. ("q_proj", "v_proj")
    layers: dict[tuple[int, str], FusedLora] = field(repr=False)  # (layer, projection) -> delta

    @property
    def num_parameters(self) -> int:
        return sum(f.a.numel() + f.b.count_nonzero().item() for f in self.layers.values())


def read_peft_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoraError(f"LoRA adapter folder not found: {path}")
    if not os.path.isfile(config_path) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise LoraError(f"{path} is not a PEFT adapter: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise LoraError(f"{config_path} could not be read: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    if config.get("peft_type") != "LORA":
        raise LoraError(f"{config_path}: peft_type must be LORA, got {config.get('peft_type')!r}")
    unsupported = {
        "bias": config.get("bias", "none") != "none",
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise LoraError(f"{config_path}: unsupported LoRA settings: {', '.join(bad)}")
    return config


def load_peft_adapter(
    name: str, path: str, args: ModelArgs, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoraAdapter:
    """Read and check an adapter against the model; raises LoraError."""
    config = read_peft_config(path)
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise LoraError(f"{name}: lora_alpha must be a positive number, got {alpha!r}")
    rslora = bool(config.get("use_rslora"))
    try:
        weights = _read_weights(name, os.path.join(path, WEIGHTS_FILE), args)
    except LoraError:
        raise
    except Exception as exc:  # a corrupt or truncated file: safetensors' own error, in our words
        raise LoraError(f"{name}: {WEIGHTS_FILE} could not be read: {type(exc).__name__}: {exc}") from exc
    if not weights:
        raise LoraError(f"{name}: {WEIGHTS_FILE} holds no LoRA weights")
    shapes = part_shapes(args)
    grouped: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, module), pair in sorted(weights.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{name}: layer {layer} {module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        projection, part = PARTS[module]
        outs, fan_in = shapes[projection]
        r = a.shape[0] if a.dim() == 2 else -1
        if r < 1 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (outs[part], r):
            raise LoraError(
                f"{name}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"the model needs A (r, {fan_in}) and B ({outs[part]}, r)"
            )
        if r > max_rank:
            raise LoraError(f"{name}: rank {r} is over max_lora_rank={max_rank}")
        rank = max(rank, r)
        # PEFT's scaling, from the module's own rank (rank_pattern gives modules their own).
        scaling = alpha / (math.sqrt(r) if rslora else r)
        grouped.setdefault((layer, projection), []).append((part, a, b * scaling))
    layers = {key: _fuse(parts, shapes[key[1]][0], dtype, device) for key, parts in grouped.items()}
    targets = tuple(sorted({module for _, module in weights}))
    return LoraAdapter(name, os.path.abspath(path), rank, targets, layers)


def _read_weights(name: str, file: str, args: ModelArgs) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, PEFT module) -> {"A": ..., "B": ...}, every key checked against the model."""
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(file, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            m = WEIGHT_KEY.match(key)
            block, _, module = m.group(2).partition(".") if m else ("", "", "")
            if m is None or BLOCKS.get(module) != block:
                raise LoraError(f"{name}: weight {key} targets a module this model does not have")
            layer = int(m.group(1))
            if layer >= args.num_layers:
                raise LoraError(f"{name}: weight {key} is for layer {layer}; the model has {args.num_layers}")
            weights.setdefault((layer, module), {})[m.group(3)] = f.get_tensor(key)
    return weights


def _fuse(
    parts: list[tuple[int, torch.Tensor, torch.Tensor]], outs: list[int], dtype: torch.dtype, device: torch.device
) -> FusedLora:
    total_r = sum(a.shape[0] for _, a, _ in parts)
    b = torch.zeros(sum(outs), total_r)
    r0 = 0
    for part, a, part_b in parts:
        o0 = sum(outs[:part])
        b[o0 : o0 + outs[part], r0 : r0 + a.shape[0]] = part_b
        r0 += a.shape[0]
    a = torch.cat([a for _, a, _ in parts])
    return FusedLora(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())


@dataclass
class LoraStep:
    """The adapters of one step's rows: per adapter, the rows (of the flattened batch)
    that run under it. Rows of no adapter are absent."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]  # (adapter, row indices (n,) int64)

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += the adapter's delta of x[rows], for each adapter of the step."""
        for adapter, rows in self.groups:
            fused = adapter.layers.get((layer, projection))
            if fused is None:
                continue
            if rows.numel() == x.shape[0]:  # every row under one adapter: no gather
                out += fused.delta(x)
            else:
                out.index_add_(0, rows, fused.delta(x.index_select(0, rows)))


class LoraRegistry:
    """The adapters loaded, by name (what clients ask for) and by the uid each load gets
    (what a request's AdapterRef carries). Loads and unloads come from the event loop's
    side while the engine thread reads: each is one dict assignment."""

    def __init__(self, args: ModelArgs, max_rank: int, dtype: torch.dtype, device: torch.device, base_names=()):
        self.args, self.max_rank, self.dtype, self.device = args, max_rank, dtype, device
        self.base_names = frozenset(base_names)
        self.refs: dict[str, AdapterRef] = {}
        self.adapters: dict[int, LoraAdapter] = {}
        self._uids = itertools.count(1)
        self._lock = threading.Lock()  # two loads of one name: the second is refused

    def load(self, name: str, path: str) -> AdapterRef:
        if not name:
            raise LoraError("a LoRA adapter needs a name")
        self._check_free(name)
        adapter = load_peft_adapter(name, path, self.args, self.max_rank, self.dtype, self.device)
        cost = adapter.num_parameters / base_linear_parameters(self.args)
        with self._lock:
            self._check_free(name)
            ref = AdapterRef(name, next(self._uids), cost)
            self.adapters[ref.uid] = adapter
            self.refs[name] = ref
        return ref

    def _check_free(self, name: str) -> None:
        if name in self.refs or name in self.base_names:
            raise LoraError(f"the name {name!r} is already taken by a loaded model or adapter")

    def unload(self, name: str) -> None:
        with self._lock:
            ref = self.refs.pop(name)
            del self.adapters[ref.uid]

    def loaded(self) -> dict[str, str]:
        """name -> folder of every adapter loaded."""
        with self._lock:
            return {name: self.adapters[ref.uid].path for name, ref in self.refs.items()}

    def ref(self, name: str) -> AdapterRef | None:
        return self.refs.get(name)

    def step(self, rows: list[tuple[AdapterRef | None, int]]) -> LoraStep | None:
        """The step's LoRA work from each sequence's (adapter, rows in the batch), in
        batch order; None when every row is the base model's."""
        if all(ref is None for ref, _ in rows):
            return None
        spans: dict[int, list[range]] = {}
        start = 0
        for ref, n in rows:
            if ref is not None:
                spans.setdefault(ref.uid, []).append(range(start, start + n))
            start += n
        groups = [
            (self.adapters[uid], torch.tensor([i for r in ranges for i in r], dtype=torch.int64, device=self.device))
            for uid, ranges in spans.items()
        ]
        return LoraStep(groups)
