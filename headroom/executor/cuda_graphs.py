"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU:
each layer launches about ten kernels of a few microseconds' work. A CUDA graph records
one step's launches once and replays them all with one call. A graph has fixed shapes
and reads fixed addresses, so one graph is captured per batch size in a short list, all
reading slices of one set of static input buffers. A decode batch is padded up to the
next captured size and copied into those buffers before the replay.

Padding rows must not touch any sequence's cache: each one is a one-token context in
a reserved KV block that the BlockManager never hands out (ModelRunner allocates it
past the end of the pool), so the K/V they write and read are scratch.

Only pure-decode batches are replayed, and only with backends whose forward reads
nothing but device tensors (flash-attn's and ours in Triton). Prefill steps, larger
batches, and the torch and xformers backends (whose forward loops over host-side
lengths) run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Sequence

import torch

from headroom.config import Config
from headroom.contracts.attention import AttentionBackend, AttentionMetadata
from headroom.models.llama import ForwardContext, Llama

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """The batch sizes to capture when at most max_num_seqs sequences run: every listed
    size below it, and max_num_seqs itself so the largest batch never runs eagerly."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return tuple(sorted({s for s in sizes if 0 < s < max_num_seqs} | {max_num_seqs}))


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds n rows, or None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def graph_plan(config: Config, device: torch.device, backend: AttentionBackend) -> tuple[tuple[int, ...], str]:
    """Decode batch sizes to capture, and what to say about it at start and in /health."""
    if device.type != "cuda":
        return (), f"off (no CUDA graphs on {device.type})"
    if config.model.enforce_eager:
        return (), "off (enforce_eager)"
    if not supports_graphs(backend):
        return (), f"off (the {backend.name} backend reads host-side lengths in its forward)"
    sizes = capture_sizes(config.scheduler.max_num_seqs, config.model.cuda_graph_sizes)
    return sizes, "decode batch sizes " + ",".join(map(str, sizes))


def supports_graphs(backend: AttentionBackend) -> bool:
    return bool(getattr(backend, "cuda_graphs", False))


class DecodeGraphs:
    """Static input buffers for decode batches of up to max(sizes) rows, and one
    captured graph per size once capture() has run (on CUDA only)."""

    def __init__(
        self,
        model: Llama,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: Sequence[int],
        block_size: int,
        max_model_len: int,
        pad_block: int,
        device: torch.device,
    ):
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(sizes))
        self.max_model_len = max_model_len
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.device = device
        rows = self.sizes[-1]
        width = math.ceil(max_model_len / block_size)

        def buf(*shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buf(rows, dtype=torch.int64)
        self.positions = buf(rows, dtype=torch.int64)
        self.slot_mapping = buf(rows, dtype=torch.int64, fill=self.pad_slot)
        self.seq_lens = buf(rows, dtype=torch.int32, fill=1)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.seq_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.block_tables = buf(rows, width, dtype=torch.int32, fill=pad_block)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_decodes == num_seqs and 0 < num_seqs <= self.max_batch

    def _metadata(self, size: int) -> AttentionMetadata:
        # The host-side lengths are upper bounds here: a graph-safe backend never reads them.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_start_loc=self.seq_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        ctx = ForwardContext(meta=self._metadata(size), kv_caches=self.kv_caches, backend=self.backend)
        return self.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, all in one memory pool (a smaller
        graph's intermediates fit in what the largest one reserved)."""
        started = time.perf_counter()
        dev = self.device
        with torch.cuda.device(dev):
            free_before = torch.cuda.mem_get_info(dev)[0]
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device=dev)
            for size in reversed(self.sizes):
                # Outside capture first: Triton compiles its kernels and cuBLAS sets up its
                # workspaces on the first call, neither of which may happen inside a graph.
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._forward(size)
                torch.cuda.current_stream(dev).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
            torch.cuda.synchronize(dev)
            used = (free_before - torch.cuda.mem_get_info(dev)[0]) / 2**20
        log.info(
            "captured CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)",
            ",".join(map(str, self.sizes)),
            time.perf_counter() - started,
            used,
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a pure-decode batch: its rows padded up to a captured size,
        replayed from that size's graph (or run eagerly on the same static buffers where
        nothing was captured, which is how the padding is tested without a GPU)."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None or meta.num_decodes != n:
            raise ValueError(f"not a decode batch that fits a captured size: {n} rows, {meta.num_decodes} decodes")
        self._load(input_ids, positions, meta, n, size)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        self.replays += 1
        return self.outputs[size][:n]

    def _load(self, input_ids, positions, meta: AttentionMetadata, n: int, size: int) -> None:
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        # Columns past a row's last block are never read: seq_lens bounds every kernel.
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if size > n:  # rows a larger batch filled before must go back to padding
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.pad_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].fill_(self.pad_block)
        torch.cumsum(self.seq_lens[:size], 0, dtype=torch.int32, out=self.seq_start_loc[1 : size + 1])
