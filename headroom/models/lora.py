"""LoRA adapters in PEFT's format, applied to the rows of a mixed batch.

An adapter is read from a PEFT folder (adapter_config.json + adapter_model.safetensors)
and laid out for the model's fused projections: per layer and per projection (qkv, o,
gate_up, down), one A that stacks the A of every targeted part, and one B as wide as the
fused output with each part's B in its own block (zeros elsewhere), PEFT's scaling
folded in. A step's rows are grouped by adapter (Punica's SGMV shape), and base rows
cost nothing. When the step's adapters fit the max_loras slots, which hold their weights
stacked, every group runs at once through a kernel, one call a projection with nothing
padded: headroom's C++ kernel in float32 on the CPU, its Triton kernel on the GPU.
Elsewhere, where the rows are even (decode), they are gathered into one padded block per
slot, two batched matmuls a projection whatever the number of adapters. Otherwise (a
prefill chunk under one adapter beside a few decodes, on the batched matmuls) each group
is gathered, shrunk through its A, expanded through its B and added on its own.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import ModuleType

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
# How long a failed read of an adapter's folder refuses its requests at entry: a folder
# gone fails each one at once instead of after its prefill, and one put back serves again.
UNREADABLE_FOR_S = 5.0


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
    parameters: int  # the parts' own weights: b's zeros are layout, not arithmetic
    spans: torch.Tensor  # (R, 2) int64 on the CPU: the output columns [lo, hi) of each rank's part

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
        return sum(f.parameters for f in self.layers.values())


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
    spans = torch.zeros(total_r, 2, dtype=torch.int64)
    r0 = 0
    for part, a, part_b in parts:
        o0 = sum(outs[:part])
        b[o0 : o0 + outs[part], r0 : r0 + a.shape[0]] = part_b
        spans[r0 : r0 + a.shape[0]] = torch.tensor([o0, o0 + outs[part]])
        r0 += a.shape[0]
    parameters = sum(a.numel() + part_b.numel() for _, a, part_b in parts)
    a = torch.cat([a for _, a, _ in parts])
    return FusedLora(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), parameters, spans)


class LoraSlots:
    """max_loras slots, each holding one adapter's weights in stacks per projection (the
    A of slot s at a[key][s] as (in, R), its B at b[key][s] as (R, out), zero-padded to the
    widest rank placed, and at spans[key][s] the columns where each row of that B may be
    non-zero), so that one call serves every adapter of a step. Owned by the engine
    thread: written only while it prepares a step, never during one."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.uids: list[int | None] = [None] * capacity  # slot -> the adapter it holds
        self.last_used: dict[int, int] = {}  # uid -> the placement that last used it (LRU)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.spans: dict[tuple[int, str], torch.Tensor] = {}  # (S, R, 2) int64 on the CPU
        self.depth = 0  # the slots the stacks hold: 1 + the highest slot written
        self._clock = 0

    def place(self, adapters: list[tuple[int, LoraAdapter]]) -> list[int] | None:
        """The slot of each (uid, adapter), writing in those not resident over the least
        recently used others; None when they are more than the slots."""
        if len(adapters) > self.capacity:
            return None
        self._clock += 1
        wanted = {uid for uid, _ in adapters}
        slots = []
        for uid, adapter in adapters:
            if uid in self.uids:
                slot = self.uids.index(uid)
            else:
                slot = min(
                    (s for s, held in enumerate(self.uids) if held not in wanted),
                    key=lambda s: -1 if self.uids[s] is None else self.last_used.get(self.uids[s], -1),
                )
                self.last_used.pop(self.uids[slot], None)
                self._write(slot, adapter)
                self.uids[slot] = uid
            self.last_used[uid] = self._clock
            slots.append(slot)
        return slots

    def forget(self, uid: int) -> None:
        if uid in self.uids:
            self.uids[self.uids.index(uid)] = None
        self.last_used.pop(uid, None)

    def make_room(self, adapter: LoraAdapter) -> None:
        """Grow the stacks so that `adapter` can be written over any slot in use without
        allocating."""
        for key, fused in adapter.layers.items():
            self._grow(key, fused.a.shape[1], fused.b.shape[0], self.depth, fused.a.shape[0], fused.a)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        # Every stack is as deep as the deepest slot written: a projection first placed at
        # slot 1 still serves a step whose other adapter sits in slot 5 (as zeros there).
        self.depth = max(self.depth, slot + 1)
        for key, fused in adapter.layers.items():
            r = fused.a.shape[0]
            self._grow(key, fused.a.shape[1], fused.b.shape[0], self.depth, r, fused.a)
            a, b, spans = self.a[key][slot], self.b[key][slot], self.spans[key][slot]
            a[:, r:].zero_()
            b[r:].zero_()
            spans.zero_()
            a[:, :r] = fused.a.t()
            b[:r] = fused.b.t()
            spans[:r] = fused.spans
        for key in self.a.keys() - adapter.layers.keys():  # projections it leaves alone
            a = self.a[key]
            self._grow(key, a.shape[1], self.b[key].shape[2], self.depth, a.shape[2], a)
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
            self.spans[key][slot].zero_()

    def _grow(self, key: tuple[int, str], fan_in: int, out: int, slots: int, r: int, like: torch.Tensor) -> None:
        """Make key's stacks at least `slots` slots deep and r ranks wide, keeping what they
        hold. Only the slots in use are allocated (place fills the lowest free ones first):
        a stack's zeros are written page by page, at a cost the step that first needs them pays."""
        if key in self.a and self.a[key].shape[0] >= slots and self.a[key].shape[2] >= r:
            return
        if key in self.a:
            slots, r = max(slots, self.a[key].shape[0]), max(r, self.a[key].shape[2])
        a = like.new_zeros(slots, fan_in, r)
        b = like.new_zeros(slots, r, out)
        spans = torch.zeros(slots, r, 2, dtype=torch.int64)
        if key in self.a:
            held, old = self.a[key].shape[0], self.a[key].shape[2]
            a[:held, :, :old] = self.a[key]
            b[:held, :old] = self.b[key]
            spans[:held, :old] = self.spans[key]
        self.a[key], self.b[key], self.spans[key] = a, b, spans


@dataclass
class PaddedRows:
    """A step's adapter rows laid out as `width` slots of `depth` rows each."""

    slots: LoraSlots
    width: int  # the slots spanned (1 + the highest slot of the step)
    depth: int  # the rows of the fullest slot
    gather: torch.Tensor  # (width * depth,) the batch row at each padded place (0 where empty)
    places: torch.Tensor  # (k,) the padded places that hold rows
    rows: torch.Tensor  # (k,) the batch row of each of those places

    def add(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor) -> None:
        a, b = self.slots.a[key][: self.width], self.slots.b[key][: self.width]
        # Empty places gather row 0: their results are computed and never read.
        xs = x.index_select(0, self.gather).view(self.width, self.depth, -1)
        ys = torch.bmm(torch.bmm(xs, a), b).view(self.width * self.depth, -1)
        out.index_add_(0, self.rows, ys.index_select(0, self.places))


@dataclass
class SlotRows:
    """A step's adapter rows grouped by slot, for a kernel that runs every group of a
    projection in one call and pads nothing (kernels/linear/lora_add.cpp on the CPU,
    kernels/lora_triton.py on the GPU: the same call)."""

    slots: LoraSlots
    kernels: ModuleType
    rows: torch.Tensor  # (k,) the batch rows, group after group
    starts: torch.Tensor  # (groups + 1,) where each group begins in rows
    held: torch.Tensor  # (groups,) the slot of each group

    def add(self, key: tuple[int, str], x: torch.Tensor, out: torch.Tensor) -> None:
        slots = self.slots
        self.kernels.lora_add_(out, x, slots.a[key], slots.b[key], slots.spans[key], self.rows, self.starts, self.held)


@dataclass
class LoraStep:
    """The adapters of one step's rows: per adapter, the rows (of the flattened batch)
    that run under it. Rows of no adapter are absent."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]  # (adapter, row indices (n,) int64), each run alone
    padded: PaddedRows | SlotRows | None = None  # the groups that run together, from the slots
    # uid -> why its weights could not be read again: its rows run as the base model's,
    # and the engine fails their sequences instead of sending what they sampled.
    failed: dict[int, str] = field(default_factory=dict)

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[rows] += the adapter's delta of x[rows], for each adapter of the step."""
        key = (layer, projection)
        if self.padded is not None and key in self.padded.slots.a:
            self.padded.add(key, x, out)
        for adapter, rows in self.groups:
            fused = adapter.layers.get((layer, projection))
            if fused is None:
                continue
            if rows.numel() == x.shape[0]:  # every row under one adapter: no gather
                out += fused.delta(x)
            else:
                out.index_add_(0, rows, fused.delta(x.index_select(0, rows)))


class LoraRegistry:
    """The adapters registered, by name (what clients ask for) and by the uid each load gets
    (what a request's AdapterRef carries), with the weights of at most max_cpu_loras of them
    in memory: the least recently used leave first, and are read again from their folder
    by the step that next runs them. Loads come from the event loop's side, unloads and
    steps from the engine thread; the lock orders their writes."""

    def __init__(
        self,
        args: ModelArgs,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        base_names=(),
        max_loras: int = 8,
        kernels: ModuleType | None = None,
        max_cpu_loras: int | None = None,
    ):
        """kernels: a module whose lora_add_ runs the slots' groups (headroom's C++ kernels
        for float32 on the CPU, kernels/lora_triton on the GPU); None: torch's matmuls.
        max_cpu_loras: the most adapters whose weights stay in memory (None: all)."""
        self.args, self.max_rank, self.dtype, self.device = args, max_rank, dtype, device
        self.kernels = kernels
        self.slots = LoraSlots(max_loras)
        self.max_cpu_loras = max_cpu_loras
        self.base_names = frozenset(base_names)
        self.refs: dict[str, AdapterRef] = {}
        self.folders: dict[int, tuple[str, str]] = {}  # uid -> (name, folder) of every adapter registered
        self.adapters: OrderedDict[int, LoraAdapter] = OrderedDict()  # uid -> weights in memory, oldest use first
        self.reloads = 0  # weights read again after they left memory
        # uid -> (monotonic time, error) of its last failed read: for unreadable_for_s after
        # it, a request under it is refused when it enters instead of failing after a prefill.
        self.failed_reads: dict[int, tuple[float, str]] = {}
        self.unreadable_for_s = UNREADABLE_FOR_S
        # The adapters of the running sequences, as the engine last scheduled them: their
        # weights never leave memory (the scheduler holds them to max_loras <= max_cpu_loras).
        self.running: frozenset[int] = frozenset()
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
            self.folders[ref.uid] = (name, adapter.path)
            self.adapters[ref.uid] = adapter
            self.refs[name] = ref
            self._evict(keep={ref.uid})
        return ref

    def warm(self) -> None:
        """Write the adapters in memory into the slots now, as many as there are slots, so
        that the first steps under them allocate nothing (the engine's start calls it)."""
        with self._lock:
            held = list(self.adapters.items())[-self.slots.capacity :]
        self.slots.place(held)

    def warm_loaded(self, uid: int) -> None:
        """Write an adapter loaded at run time into a free slot, or where none is free,
        make the stacks wide enough for it, so that its first step allocates nothing; no
        adapter in a slot leaves (the engine thread calls it between steps)."""
        with self._lock:
            adapter = self.adapters.get(uid)
        if adapter is None:  # unloaded, or already out of memory again
            return
        if None in self.slots.uids:
            self.slots.place([(uid, adapter)])
        else:
            self.slots.make_room(adapter)

    def _check_free(self, name: str) -> None:
        if name in self.refs or name in self.base_names:
            raise LoraError(f"the name {name!r} is already taken by a loaded model or adapter")

    def unload(self, name: str) -> None:
        with self._lock:
            ref = self.refs.pop(name)
            del self.folders[ref.uid]
            self.failed_reads.pop(ref.uid, None)
            self.adapters.pop(ref.uid, None)
        self.slots.forget(ref.uid)  # unloads run on the engine thread, between steps

    def loaded(self) -> dict[str, str]:
        """name -> folder of every adapter registered (in memory or not)."""
        with self._lock:
            return {name: self.folders[ref.uid][1] for name, ref in self.refs.items()}

    def ref(self, name: str) -> AdapterRef | None:
        return self.refs.get(name)

    def registered(self, uid: int) -> bool:
        return uid in self.folders

    def unreadable(self, uid: int) -> str | None:
        """Why uid's weights could not be read, where a read failed within unreadable_for_s
        (engine thread: the steps' reads write it)."""
        failure = self.failed_reads.get(uid)
        if failure is None or time.monotonic() - failure[0] >= self.unreadable_for_s:
            return None
        return failure[1]

    def weights(self, uids) -> tuple[dict[int, LoraAdapter], dict[int, LoraError]]:
        """Each uid's weights, read again from its folder where they had left memory (on the
        engine thread: the step waits for the read), and apart the uids whose folder no
        longer reads, each with its error; then the least recently used others beyond
        max_cpu_loras leave."""
        # The adapters in memory held by reference, the others read outside the lock (a read
        # from disk never holds up /v1/models); a load meanwhile may evict what is held here,
        # and putting it back is then right. Only this thread unloads: the folders stay.
        held = {uid: self.adapters.get(uid) for uid in uids}
        found, failed = {}, {}
        for uid, adapter in held.items():
            try:
                found[uid] = adapter or load_peft_adapter(
                    *self.folders[uid], self.args, self.max_rank, self.dtype, self.device
                )
            except LoraError as exc:
                failed[uid] = exc
                self.failed_reads[uid] = (time.monotonic(), str(exc))
        for uid in found:
            self.failed_reads.pop(uid, None)
        with self._lock:
            for uid, adapter in found.items():
                self.adapters[uid] = adapter
                self.adapters.move_to_end(uid)
            self.reloads += sum(held[uid] is None for uid in found)
            self._evict(keep=found.keys())
        return found, failed

    def _evict(self, keep) -> None:
        """Drop the least recently used weights beyond max_cpu_loras, never those in keep nor
        the running sequences' (a load beside max_loras running adapters may hold one more
        until the next step). An adapter's slot keeps its copy: the same folder gives the
        same weights."""
        if self.max_cpu_loras is None:
            return
        kept = keep | self.running
        for uid in [u for u in self.adapters if u not in kept][: max(0, len(self.adapters) - self.max_cpu_loras)]:
            del self.adapters[uid]

    def step(self, rows: list[tuple[AdapterRef | None, int]]) -> LoraStep | None:
        """The step's LoRA work from each sequence's (adapter, rows in the batch), in
        batch order; None when every row is the base model's."""
        if all(ref is None for ref, _ in rows):
            return None
        spans: dict[int, list[int]] = {}
        start = 0
        for ref, n in rows:
            if ref is not None:
                spans.setdefault(ref.uid, []).extend(range(start, start + n))
            start += n
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=self.device)
        adapters, errors = self.weights(spans)
        failed = {uid: str(exc) for uid, exc in errors.items()}
        spans = {uid: r for uid, r in spans.items() if uid not in failed}
        if not spans:
            return LoraStep([], failed=failed)
        if self.kernels is not None:
            grouped = self._group(spans, adapters, as_tensor)
            if grouped is not None:
                return LoraStep([], grouped, failed)
            return LoraStep([(adapters[uid], as_tensor(r)) for uid, r in spans.items()], failed=failed)
        # Groups of a few rows (decodes) run together through the slots; a group far larger
        # than the typical one (a prefill chunk) runs on its own, where one matmul over its
        # rows is already efficient and padding the others to its size would not be.
        sizes = sorted(len(r) for r in spans.values())
        typical = sizes[(len(sizes) - 1) // 2]
        small = {uid: r for uid, r in spans.items() if len(r) <= 2 * typical}
        padded = self._pad(small, adapters, as_tensor) if len(small) >= 2 else None
        alone = spans if padded is None else {uid: r for uid, r in spans.items() if uid not in small}
        return LoraStep([(adapters[uid], as_tensor(r)) for uid, r in alone.items()], padded, failed)

    def _group(self, spans: dict[int, list[int]], adapters: dict[int, LoraAdapter], as_tensor) -> SlotRows | None:
        """Every row of `spans` by slot for the kernel; None when the slots cannot take them."""
        placed = self.slots.place([(uid, adapters[uid]) for uid in spans])
        if placed is None:
            return None
        starts = [0, *itertools.accumulate(len(r) for r in spans.values())]
        rows = [i for r in spans.values() for i in r]
        return SlotRows(self.slots, self.kernels, as_tensor(rows), as_tensor(starts), as_tensor(placed))

    def _pad(self, spans: dict[int, list[int]], adapters: dict[int, LoraAdapter], as_tensor) -> PaddedRows | None:
        """The rows of `spans` laid out by slot; None when the slots cannot take them or
        padding would cost more than it saves."""
        placed = self.slots.place([(uid, adapters[uid]) for uid in spans])
        if placed is None:
            return None
        width, depth = max(placed) + 1, max(len(r) for r in spans.values())
        if width * depth > 2 * sum(len(r) for r in spans.values()):
            return None
        gather = [0] * (width * depth)
        places: list[int] = []
        for slot, rows in zip(placed, spans.values(), strict=True):
            first = slot * depth
            gather[first : first + len(rows)] = rows
            places.extend(range(first, first + len(rows)))
        rows = [i for r in spans.values() for i in r]
        return PaddedRows(self.slots, width, depth, as_tensor(gather), as_tensor(places), as_tensor(rows))
