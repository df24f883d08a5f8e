"""Builds one flattened batch per step, runs the model over the paged cache, and
returns the logits of the sequences that sample this step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from headroom.contracts.attention import AttentionBackend, AttentionMetadata
from headroom.contracts.schedule import BlockTables, SchedulerOutput
from headroom.executor.attention.kv_rows import cache_shape, row_width
from headroom.executor.cuda_graphs import DecodeGraphs
from headroom.models.llama import ForwardContext, Llama, ModelArgs
from headroom.models.lora import LoraRegistry, LoraStep

log = logging.getLogger(__name__)


def kv_block_bytes(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * block_size * args.num_kv_heads * row_width(args.head_dim, dtype) * elem


class ModelOutput:
    def __init__(
        self,
        logits: torch.Tensor,
        sample_indices: list[int],
        timer: StepTimer,
        hidden: dict[int, torch.Tensor] | None = None,
        lora_failed: dict[int, str] | None = None,
    ):
        # (S + G, V) float32: the S sampling requests', then the rows after each of the G
        # guesses (SchedulerOutput.drafts), request by request.
        self.logits = logits
        self.sample_indices = sample_indices  # positions in SchedulerOutput.requests that sample
        self.timer = timer  # device time of the forward pass
        self.hidden = hidden or {}  # layer -> (S, hidden): residual stream after it, as logits
        # LoRA uid -> why its weights could not be read: its rows ran as the base model's.
        self.lora_failed = lora_failed or {}


class StepTimer:
    """Wall time on the CPU; CUDA events on a GPU, so that timing a step never makes
    the host wait for the device: read elapsed_s() once ready() (a step's events are
    done by the time a later step's sampled ids reach the host)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._stream = torch.cuda.current_stream(device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(self._stream)
        else:
            self._started = time.perf_counter()
            self._elapsed = 0.0

    def stop(self) -> StepTimer:
        if self.cuda:
            self._end.record(self._stream)
        else:
            self._elapsed = time.perf_counter() - self._started
        return self

    def ready(self) -> bool:
        return not self.cuda or self._end.query()

    def elapsed_s(self) -> float:
        if self.cuda:
            return self._start.elapsed_time(self._end) / 1000.0  # waits if not ready()
        return self._elapsed


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # rows of the hidden states whose logits are needed: sampling, then guess rows
    sample_indices: list[int]
    lora: LoraStep | None = None  # the rows that run under adapters


class ModelRunner:
    def __init__(
        self,
        model: Llama,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        graph_sizes: tuple[int, ...] = (),
        max_model_len: int | None = None,
        loras: LoraRegistry | None = None,
    ):
        """graph_sizes: decode batch sizes to serve from CUDA graphs (empty: always eager)."""
        self.model = model
        self.loras = loras
        self.backend = backend
        self.block_size = block_size
        self.device = device
        args = model.args
        # One block past the pool's end is scratch for the padding rows of graphed
        # decode batches; the BlockManager only knows num_blocks, so never hands it out.
        shape = cache_shape(
            num_blocks + (1 if graph_sizes else 0), block_size, args.num_kv_heads, args.head_dim, kv_dtype
        )
        # flash-attn's paged layout, one K and one V tensor per layer. Zeroed, so the whole
        # pool is committed at start: free blocks are handed out least recently freed
        # first, so a pool committed as written would grow under load until every block
        # had been touched (RSS creeping for minutes reads as a leak), and a pool too
        # large for the machine would fail then rather than here. Zeros also keep padded
        # reads of unwritten slots finite.
        self.kv_caches = [
            (torch.zeros(shape, dtype=kv_dtype, device=device), torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(args.num_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        # Decoder layers whose residual stream at the sampling rows a step keeps
        # (ModelOutput.hidden), for the length probe and its calibration.
        self.hidden_layers: frozenset[int] = frozenset()
        if graph_sizes:
            self.graphs = DecodeGraphs(
                model,
                backend,
                self.kv_caches,
                graph_sizes,
                block_size,
                max_model_len or args.max_position_embeddings,
                num_blocks,
                device,
            )

    def capture_graphs(self) -> str | None:
        """Capture the decode graphs; on failure, say why and run every step eagerly."""
        if self.graphs is None:
            return None
        try:
            self.graphs.capture()
        except Exception as exc:  # e.g. out of memory or a kernel that cannot be captured
            log.exception("CUDA graph capture failed; decode runs eagerly")
            self.graphs = None
            return f"off (capture failed: {type(exc).__name__}: {exc})"
        return None

    def prepare(self, out: SchedulerOutput, block_manager: BlockTables) -> BatchInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sample_indices: list[int] = []
        guess_rows: list[int] = []  # the rows after each guess, after the sampling rows
        num_decodes = out.num_decodes  # rows of one query token, first in the batch
        for i, (request, n) in enumerate(zip(out.requests, out.num_scheduled_tokens, strict=True)):
            start = request.num_computed_tokens
            end = start + n
            table = block_manager.block_table(request.request_id)
            guess = out.drafts.get(request.request_id, [])
            input_ids.extend(request.all_token_ids[start : end - len(guess)])
            input_ids.extend(guess)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if guess:
                # Each position a decode row of its own over the same blocks (this step's
                # K/V are all written before any row reads), so that each is computed as
                # decoding it one token a step computes it.
                query_lens.extend([1] * n)
                seq_lens.extend(range(start + 1, end + 1))
                tables.extend([table] * n)
                num_decodes += n  # out.num_decodes counts rows of one token only
            else:
                query_lens.append(n)
                seq_lens.append(end)
                tables.append(table)
            if end == request.num_tokens + len(guess):
                last = len(input_ids) - 1 - len(guess)
                logits_rows.append(last)
                guess_rows.extend(range(last + 1, last + 1 + len(guess)))
                sample_indices.append(i)
        width = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        cu_q = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_k = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(torch.tensor(slots, dtype=torch.int64)),
            query_start_loc=to(cu_q),
            seq_start_loc=to(cu_k),
            seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=to(table_tensor),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return BatchInputs(
            input_ids=to(torch.tensor(input_ids, dtype=torch.int64)),
            positions=to(torch.tensor(positions, dtype=torch.int64)),
            meta=meta,
            logits_rows=to(torch.tensor(logits_rows + guess_rows, dtype=torch.int64)),
            sample_indices=sample_indices,
            lora=self.loras.step([(r.lora, n) for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)])
            if self.loras is not None and self.loras.refs
            else None,
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_manager: BlockTables, keep_hidden: bool = True) -> ModelOutput:
        """keep_hidden: keep the rows of hidden_layers this step (a step that keeps them runs
        eagerly, never from a CUDA graph)."""
        batch = self.prepare(out, block_manager)
        timer = StepTimer(self.device)
        meta = batch.meta
        keeping = keep_hidden and bool(self.hidden_layers) and bool(batch.sample_indices)
        ctx = ForwardContext(
            meta=meta,
            kv_caches=self.kv_caches,
            backend=self.backend,
            hidden_rows=batch.logits_rows[: len(batch.sample_indices)] if keeping else None,
            hidden_layers=self.hidden_layers,
            lora=batch.lora,
        )
        # Graphs were captured without adapters: a step with LoRA rows runs eagerly.
        if (
            self.graphs is not None
            and not keeping
            and batch.lora is None
            and self.graphs.can_run(meta.num_seqs, meta.num_decodes)
        ):
            hidden = self.graphs.run(batch.input_ids, batch.positions, meta)
        else:
            hidden = self.model(batch.input_ids, batch.positions, ctx)
        logits = self.model.compute_logits(hidden[batch.logits_rows]) if batch.sample_indices else hidden[:0]
        failed = batch.lora.failed if batch.lora is not None else None
        return ModelOutput(logits, batch.sample_indices, timer.stop(), ctx.hidden, failed)
