"""Attention backends against a naive oracle, and the registry that picks one."""

from __future__ import annotations

import importlib
import itertools
import random
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention import available_backends, select_backend
from headroom.executor.attention.kv_rows import from_rows, to_rows
from headroom.executor.attention.torch_ref import TorchAttention, write_kv
from headroom.kernels import cpu_kernels
from tests.gpu import gpu_backend_unusable, gpu_package

CPU = torch.device("cpu")
HEAD_DIM = 64
GPU_DTYPES = [torch.float16, torch.bfloat16]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    # These tensors are tiny; on a busy 2-core box intra-op threads made them ~40x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Batch:
    q: torch.Tensor  # (N, Hq, D)
    k: torch.Tensor  # (N, Hkv, D)
    v: torch.Tensor
    k_cache: torch.Tensor  # (num_blocks, block_size, Hkv, D)
    v_cache: torch.Tensor
    meta: AttentionMetadata
    # The whole context of each sequence, cached prefix then new tokens: (seq_len, Hkv, D).
    ctx_k: list[torch.Tensor]
    ctx_v: list[torch.Tensor]
    scale: float

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        """A copy on device/dtype; every float tensor is rounded to dtype once, here."""

        def move(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)

        meta = self.meta
        return replace(
            self,
            q=move(self.q),
            k=move(self.k),
            v=move(self.v),
            k_cache=move(self.k_cache),
            v_cache=move(self.v_cache),
            meta=replace(
                meta,
                slot_mapping=move(meta.slot_mapping),
                query_start_loc=move(meta.query_start_loc),
                seq_start_loc=move(meta.seq_start_loc),
                seq_lens=move(meta.seq_lens),
                block_tables=move(meta.block_tables),
            ),
            ctx_k=[move(x) for x in self.ctx_k],
            ctx_v=[move(x) for x in self.ctx_v],
        )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> Batch:
    """A float32 CPU batch whose sequences own random, scattered blocks of a noisy cache."""
    assert all(0 < q <= s for q, s in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks nobody owns
    pool = rng.sample(range(num_blocks), sum(blocks_per_seq))
    tables, used = [], 0
    for n in blocks_per_seq:
        tables.append(pool[used : used + n])
        used += n
    block_tables = torch.zeros(len(tables), max(blocks_per_seq), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

    # Noise everywhere, so reading a slot outside a sequence's context shows up.
    k_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)

    ctx_k, ctx_v, new_slots = [], [], []
    for table, q_len, seq_len in zip(tables, q_lens, seq_lens):
        positions = range(seq_len)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])
        keys = randn(seq_len, num_kv_heads, head_dim)
        values = randn(seq_len, num_kv_heads, head_dim)
        cached = seq_len - q_len
        flat_k[slots[:cached]] = keys[:cached]
        flat_v[slots[:cached]] = values[:cached]
        ctx_k.append(keys)
        ctx_v.append(values)
        new_slots.append(slots[cached:])

    def cumsum(lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    meta = AttentionMetadata(
        slot_mapping=torch.cat(new_slots).long(),
        query_start_loc=cumsum(q_lens),
        seq_start_loc=cumsum(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_decodes=next((i for i, q in enumerate(q_lens) if q > 1), len(q_lens)),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )
    assert all(q == 1 for q in q_lens[: meta.num_decodes]), "decodes must come first"
    return Batch(
        q=randn(sum(q_lens), num_heads, head_dim),
        k=torch.cat([x[s - n :] for x, n, s in zip(ctx_k, q_lens, seq_lens)]),
        v=torch.cat([x[s - n :] for x, n, s in zip(ctx_v, q_lens, seq_lens)]),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        scale=head_dim**-0.5,
    )


def mixed_lens(rng: random.Random, num_decodes: int, num_prefills: int, block_size: int) -> tuple[list[int], list[int]]:
    """Decodes first, then prefills alternating fresh (no cache) and chunked (cached prefix)."""
    q_lens = [1] * num_decodes
    seq_lens = [rng.randint(1, 3 * block_size) for _ in range(num_decodes)]
    for i in range(num_prefills):
        q_len = rng.randint(2, block_size + 3)
        prefix = 0 if i % 2 == 0 else rng.randint(1, 2 * block_size)
        q_lens.append(q_len)
        seq_lens.append(prefix + q_len)
    return q_lens, seq_lens


def naive_attention(batch: Batch) -> torch.Tensor:
    """Softmax attention per sequence from the true contexts; never reads the cache."""
    q, meta = batch.q.double(), batch.meta
    num_heads, num_kv_heads = q.shape[1], batch.ctx_k[0].shape[1]
    out = torch.empty_like(q)
    lo = 0
    for q_len, seq_len, keys, values in zip(meta.query_lens_cpu, meta.seq_lens_cpu, batch.ctx_k, batch.ctx_v):
        keys = keys.double().repeat_interleave(num_heads // num_kv_heads, dim=1)  # (L, Hq, D)
        values = values.double().repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo : lo + q_len], keys) * batch.scale
        # Query j sits at position seq_len - q_len + j and sees keys up to there.
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[lo : lo + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        lo += q_len
    return out.to(batch.q.dtype)


def run(backend, batch: Batch) -> torch.Tensor:
    return backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)


def assert_cache_written(batch: Batch, before: Batch) -> None:
    """The new k/v sit at their slots and every other slot is untouched."""
    slots = batch.meta.slot_mapping
    pairs = ((batch.k_cache, before.k_cache, batch.k), (batch.v_cache, before.v_cache, batch.v))
    for cache, old, new in pairs:
        flat, flat_old = cache.flatten(0, 1), old.flatten(0, 1)
        torch.testing.assert_close(flat[slots], to_rows(new, cache.dtype), rtol=0, atol=0)
        keep = torch.ones(flat.shape[0], dtype=torch.bool, device=flat.device)
        keep[slots] = False
        torch.testing.assert_close(flat[keep], flat_old[keep], rtol=0, atol=0)


def clone(batch: Batch) -> Batch:
    return replace(batch, k_cache=batch.k_cache.clone(), v_cache=batch.v_cache.clone())


def check_torch_backend(batch: Batch) -> None:
    before = clone(batch)
    out = run(TorchAttention(), batch)
    torch.testing.assert_close(out, naive_attention(batch), rtol=1e-5, atol=1e-5)
    assert_cache_written(batch, before)


HEADS = [pytest.param(4, 4, id="mha"), pytest.param(6, 2, id="gqa3"), pytest.param(8, 2, id="gqa4")]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_torch_mixed_batch_matches_naive(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    q_lens, seq_lens = mixed_lens(random.Random(block_size + num_heads), 3, 4, block_size)
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size)
    assert batch.meta.num_decodes == 3 and batch.meta.num_seqs == 7
    check_torch_backend(batch)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("kind", ["decode_only", "prefill_only"])
def test_torch_uniform_batch_matches_naive(block_size: int, kind: str) -> None:
    rng = random.Random(7)
    decodes, prefills = (5, 0) if kind == "decode_only" else (0, 4)
    q_lens, seq_lens = mixed_lens(rng, decodes, prefills, block_size)
    batch = make_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, block_size=block_size, seed=1)
    check_torch_backend(batch)


def test_torch_decode_at_block_boundaries() -> None:
    # Contexts ending exactly on, just past and just before a block edge.
    seq_lens = [16, 17, 15, 32, 1]
    batch = make_batch([1] * 5, seq_lens, num_heads=4, num_kv_heads=2, block_size=16, seed=3)
    check_torch_backend(batch)


@st.composite
def batch_shapes(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 4))
    num_decodes = draw(st.integers(0, 3))
    num_prefills = draw(st.integers(0 if num_decodes else 1, 3))
    seq_lens = [draw(st.integers(1, 40)) for _ in range(num_decodes)]
    q_lens = [1] * num_decodes
    for _ in range(num_prefills):
        q_len = draw(st.integers(2, 20))
        q_lens.append(q_len)
        seq_lens.append(q_len + draw(st.integers(0, 30)))
    return {
        "q_lens": q_lens,
        "seq_lens": seq_lens,
        "num_heads": num_kv_heads * group,
        "num_kv_heads": num_kv_heads,
        "block_size": block_size,
        "head_dim": draw(st.sampled_from([8, 16])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=100, deadline=None)
@given(batch_shapes())
def test_torch_matches_naive_on_random_shapes(shape: dict) -> None:
    check_torch_backend(make_batch(**shape))


def rounded_to_cache(batch: Batch, dtype: torch.dtype) -> Batch:
    """The batch with a `dtype` cache: what the cache holds, and so what attention sees,
    is each context rounded to it (queries stay float32)."""
    return replace(
        batch,
        k_cache=to_rows(batch.k_cache, dtype),
        v_cache=to_rows(batch.v_cache, dtype),
        ctx_k=[from_rows(to_rows(x, dtype), torch.float32) for x in batch.ctx_k],
        ctx_v=[from_rows(to_rows(x, dtype), torch.float32) for x in batch.ctx_v],
    )


# The caches the CPU kernels read: float32, the 16-bit ones, and int8 rows with a scale each
# (executor/attention/kv_rows.py).
CPU_CACHES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def check_cpu_paged_backend(batch: Batch) -> None:
    from headroom.executor.attention.cpu_paged import CpuPagedAttention

    before = clone(batch)
    out = run(CpuPagedAttention(), batch)
    torch.testing.assert_close(out, naive_attention(batch), rtol=1e-5, atol=1e-5)
    assert_cache_written(batch, before)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("cache_dtype", CPU_CACHES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_cpu_paged_prefill_in_place_matches_naive(
    cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    # Chunks fresh and deep in a context (tiles of 8 tokens on AVX2 and 64 on AVX-512, a
    # last partial tile, passes of 16 and 64 keys with a partial last one, keys across
    # block edges) beside decodes, read in place from a scattered cache.
    q_lens = [1, 1, 3, 8, 9, 40, 17, 150]
    seq_lens = [5, 300, 3, 8, 200, 640, 47, 701]
    batch = make_batch(
        q_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=16,
        head_dim=head_dim,
        seed=num_heads,
    )
    check_cpu_paged_backend(rounded_to_cache(batch, cache_dtype))


@pytest.mark.parametrize("cache_dtype", CPU_CACHES, ids=str)
@pytest.mark.parametrize("seq_lens", [[3001], [2600, 1], [1500, 2100, 7], [40, 2600, 9, 1300]], ids=str)
def test_cpu_paged_decode_merges_spans_of_long_contexts(cache_dtype: torch.dtype, seq_lens: list[int]) -> None:
    # On AVX2 each context is cut into spans of about an equal share of the step's keys
    # (on one thread, four shares: 3001 -> 4 spans, 2600 -> 4, 2100 -> 3, ...) dealt to
    # threads, their partial softmaxes merged after; block_size 16 puts span edges inside
    # blocks, and short rows beside long ones stay whole.
    batch = make_batch(
        [1] * len(seq_lens), seq_lens, num_heads=9, num_kv_heads=3, block_size=16, head_dim=64, seed=len(seq_lens)
    )
    check_cpu_paged_backend(rounded_to_cache(batch, cache_dtype))


@pytest.mark.parametrize("head_dim", [64, 256])
def test_cpu_paged_decode_spans_on_two_threads_match_naive(head_dim: int) -> None:
    # Spans of six contexts dealt to two threads (at::parallel_for past four rows), merged
    # after; head_dim 256 as well as 64 (the tile's registers hold 64 output dims at a time).
    batch = make_batch(
        [1] * 6,
        [40, 2600, 9, 1300, 700, 3000],
        num_heads=8,
        num_kv_heads=2,
        block_size=16,
        head_dim=head_dim,
        seed=head_dim,
    )
    torch.set_num_threads(2)
    try:
        check_cpu_paged_backend(rounded_to_cache(batch, torch.float16))
    finally:
        torch.set_num_threads(1)  # the module's setting (one_cpu_thread)


@pytest.mark.parametrize("cache_dtype", CPU_CACHES, ids=str)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,seq_lens",
    [
        (32, 32, [300]),  # one span: two runs of 16 kv heads, one a thread
        (9, 3, [300]),  # three kv heads: runs of one and two
        (9, 3, [1300]),  # a row cut into three spans, each into runs of heads filling its slot in part
        (8, 2, [40, 700]),  # a whole row's span and a cut row's two
    ],
)
def test_cpu_paged_decode_cuts_few_spans_by_kv_heads_bit_for_bit(
    cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, seq_lens: list[int]
) -> None:
    # Spans that do not deal evenly to two threads are cut into runs of kv heads: the
    # outputs (a cut row's merged from its spans' partials, which each run fills in part)
    # match the reference, and bit for bit what one thread computes from whole spans.
    batch = rounded_to_cache(
        make_batch(
            [1] * len(seq_lens),
            seq_lens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            block_size=16,
            seed=len(seq_lens) + num_kv_heads,
        ),
        cache_dtype,
    )
    kernels, _ = cpu_kernels()
    meta = batch.meta

    def decode() -> torch.Tensor:
        return kernels.paged_decode_attention(
            batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, batch.scale
        )

    one = decode()
    torch.set_num_threads(2)
    try:
        two = decode()
        check_cpu_paged_backend(batch)
    finally:
        torch.set_num_threads(1)  # the module's setting (one_cpu_thread)
    assert torch.equal(two, one)


@pytest.mark.parametrize("cache_dtype", CPU_CACHES, ids=str)
def test_cpu_paged_prefill_cuts_decode_rows_beside_chunks_into_merged_spans(cache_dtype: torch.dtype) -> None:
    # A step's decode rows go through the decode kernel's spans, not per-kv-head tiles: on
    # one thread the 4,310 keys of its decode rows make spans of about 1,078 (3001 -> 3
    # spans, merged; 1300 -> 2; 9 stays whole), beside a chunk deep in a context and a
    # fresh one.
    batch = rounded_to_cache(
        make_batch(
            [1, 40, 1, 1, 12],
            [3001, 700, 9, 1300, 12],
            num_heads=9,
            num_kv_heads=3,
            block_size=16,
            head_dim=64,
            seed=11,
        ),
        cache_dtype,
    )
    check_cpu_paged_backend(batch)
    # The same spans, summed in the same order, as the decode kernel gives those rows
    # alone: bit for bit, where per-kv-head tiles rounded differently.
    kernels, _ = cpu_kernels()
    meta, decodes = batch.meta, [0, 2, 3]
    rows = meta.query_start_loc[decodes].long()
    mixed = kernels.paged_prefill_attention(
        batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, batch.scale
    )
    alone = kernels.paged_decode_attention(
        batch.q[rows], batch.k_cache, batch.v_cache, meta.block_tables[decodes], meta.seq_lens[decodes], batch.scale
    )
    assert torch.equal(mixed[rows], alone)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.int8], ids=str)
def test_cpu_paged_prefill_on_two_threads_matches_naive(cache_dtype: torch.dtype) -> None:
    # Items dealt to two threads by their work: a short chunk deep in a context (cut into
    # tiles of 8 so that both threads take some), a causal chunk from position 0 (its later
    # tiles the heavy ones, and a partial last tile), long decode rows cut into spans beside
    # short ones, their spans merged after.
    batch = make_batch(
        [1, 1, 16, 9, 150, 1],
        [40, 2600, 1416, 9, 150, 2100],
        num_heads=9,
        num_kv_heads=3,
        block_size=16,
        head_dim=64,
        seed=7,
    )
    torch.set_num_threads(2)
    try:
        check_cpu_paged_backend(rounded_to_cache(batch, cache_dtype))
    finally:
        torch.set_num_threads(1)  # the module's setting (one_cpu_thread)


@settings(max_examples=60, deadline=None)
@given(batch_shapes(), st.sampled_from([64, 128]), st.sampled_from([torch.float32, torch.float16, torch.int8]))
def test_cpu_paged_matches_naive_on_random_shapes(shape: dict, head_dim: int, cache_dtype: torch.dtype) -> None:
    check_cpu_paged_backend(rounded_to_cache(make_batch(**{**shape, "head_dim": head_dim}), cache_dtype))


def poisoned(batch: Batch) -> Batch:
    """The batch with a huge value in every cache slot outside the sequences' contexts
    (blocks of 16): one read of one would swamp the softmax."""
    used = torch.zeros(batch.k_cache.shape[0], dtype=torch.bool)
    for row, seq_len in zip(batch.meta.block_tables, batch.meta.seq_lens_cpu):
        used[row[: -(-seq_len // 16)].long()] = True
    batch.k_cache[~used] = 1e4
    batch.v_cache[~used] = 1e4
    for table, seq_len in zip(batch.meta.block_tables, batch.meta.seq_lens_cpu):
        last = table[(seq_len - 1) // 16]
        batch.k_cache[last, (seq_len - 1) % 16 + 1 :] = 1e4  # the last block's unused tail
    return batch


def test_cpu_paged_prefill_reads_only_its_own_context() -> None:
    check_cpu_paged_backend(
        poisoned(make_batch([12, 30], [12, 100], num_heads=6, num_kv_heads=2, block_size=16, head_dim=64, seed=5))
    )


# The bfloat16 dot products of prefill chunks (kernels: bf16_attention_form; paged_tile.h).
BF16_FORMS = [pytest.param(1, id="pairs"), pytest.param(2, id="amx")]


def skip_without(form: int) -> None:
    kernels, _ = cpu_kernels()
    if kernels.bf16_attention_form() < form:
        pytest.skip("this CPU or build has no such bfloat16 dot products (AVX-512 BF16 for pairs, AMX for tiles)")


def rounded_to_bf16(batch: Batch) -> Batch:
    """What the bfloat16 dot products multiply: queries times the scale, keys and values,
    each rounded to bfloat16 once (dividing by the scale again is exact where it is a
    power of two, as for head_dim 64 and 256, and within a float32 rounding elsewhere)."""
    return replace(
        batch,
        q=(batch.q * batch.scale).bfloat16().float() / batch.scale,
        ctx_k=[x.bfloat16().float() for x in batch.ctx_k],
        ctx_v=[x.bfloat16().float() for x in batch.ctx_v],
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("form", BF16_FORMS)
def test_cpu_paged_prefill_in_bfloat16_is_within_its_rounding(form, cache_dtype, head_dim, threads) -> None:
    # The batch of the float32 test above: chunks fresh and deep in a context, partial
    # tiles and passes, beside decode rows. The chunks' rows differ from float32's only by
    # the bfloat16 rounding of their operands and weights; the decode rows are float32's
    # bit for bit.
    from headroom.executor.attention.cpu_paged import CpuPagedAttention

    skip_without(form)
    q_lens = [1, 1, 3, 8, 9, 40, 17, 150]
    seq_lens = [5, 300, 3, 8, 200, 640, 47, 701]
    batch = rounded_to_cache(
        make_batch(q_lens, seq_lens, num_heads=9, num_kv_heads=3, block_size=16, head_dim=head_dim, seed=3),
        cache_dtype,
    )
    bf16 = CpuPagedAttention()
    bf16.dots = form
    torch.set_num_threads(threads)
    try:
        out, float32 = run(bf16, clone(batch)), run(CpuPagedAttention(), clone(batch))
    finally:
        torch.set_num_threads(1)  # the module's setting (one_cpu_thread)
    decode = torch.arange(2)
    chunks = torch.arange(2, sum(q_lens))
    assert torch.equal(out[decode], float32[decode])
    assert not torch.equal(out[chunks], float32[chunks])
    # Measured (a Xeon with AMX, both forms): max 0.0084 and mean 1.1e-4 from the rounded
    # operands' attention; mean 2.5e-4 from the exact one, whose values are ~1.
    err = (out - naive_attention(rounded_to_bf16(batch)))[chunks].abs()
    assert err.max().item() <= 0.02 and err.mean().item() <= 3e-4
    assert (out - naive_attention(batch))[chunks].abs().mean().item() <= 5e-4


@pytest.mark.parametrize("form", BF16_FORMS)
def test_cpu_paged_prefill_in_bfloat16_reads_only_its_own_context(form) -> None:
    # As the float32 test above: one read outside the contexts would bring a huge value
    # into a pass's scores or weighted values.
    from headroom.executor.attention.cpu_paged import CpuPagedAttention

    skip_without(form)
    batch = poisoned(
        make_batch([12, 30, 70], [12, 100, 133], num_heads=6, num_kv_heads=2, block_size=16, head_dim=64, seed=5)
    )
    backend = CpuPagedAttention()
    backend.dots = form
    err = (run(backend, batch) - naive_attention(rounded_to_bf16(batch))).abs()
    assert err.max().item() <= 0.02 and err.mean().item() <= 3e-4


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8], ids=str)
def test_cpu_paged_head_dims_off_the_tiles_take_the_portable_paths(cache_dtype: torch.dtype) -> None:
    # head_dim 80 has no tiles (they take multiples of 64): a decode-only step takes the
    # portable decode kernel (it writes the rows too), a mixed one the torch reference.
    kernels, _ = cpu_kernels()
    assert not kernels.paged_prefill_available(80)
    for q_lens, seq_lens in (([1, 1, 1], [5, 300, 17]), ([1, 1, 9, 30], [5, 300, 40, 100])):
        batch = make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, block_size=16, head_dim=80, seed=9)
        check_cpu_paged_backend(rounded_to_cache(batch, cache_dtype))


def test_torch_reference_reads_an_int8_cache() -> None:
    q_lens, seq_lens = mixed_lens(random.Random(4), 3, 4, 16)
    batch = make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, block_size=16, seed=4)
    check_torch_backend(rounded_to_cache(batch, torch.int8))


def test_the_kernel_and_torch_write_int8_rows_alike_ties_and_zeros_included() -> None:
    # Three rows a head: one whose values over its scale fall on halves (rounded to
    # nearest even by both writers), one of zeros (scale 1), one random. Both writers'
    # bytes must be equal, or a row would read back differently by the path that wrote it.
    kernels, _ = cpu_kernels()
    d, heads = 64, 2
    step = 2.0**-5  # the tie row's scale: 127 steps is its max, exactly
    ties = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 8) * step
    rows = torch.stack([ties, torch.zeros(d), torch.randn(d, generator=torch.Generator().manual_seed(0))])
    new = rows[:, None, :].expand(3, heads, d).contiguous()  # (B, Hkv, D): one token a sequence
    cache = [torch.zeros(4, 16, heads, d + 4, dtype=torch.int8) for _ in range(2)]
    tables = torch.tensor([[0], [1], [2]], dtype=torch.int32)
    slots = torch.tensor([0, 16, 32])
    q = torch.randn(3, 2 * heads, d)
    kernels.paged_decode_attention(q, *cache, tables, torch.ones(3, dtype=torch.int32), d**-0.5, new, new, slots)
    want = to_rows(new, torch.int8)
    for written in cache:
        assert torch.equal(written.view(-1, heads, d + 4)[slots], want)
    assert want[0, 0, 4:12].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert want[1, 0, :4].view(torch.float32).item() == 1.0 and not want[1, 0, 4:].any()
    assert want[0, 0, :4].view(torch.float32).item() == step


def test_cpu_paged_prefill_refuses_dot_products_it_lacks() -> None:
    kernels, _ = cpu_kernels()
    batch = make_batch([1, 9], [5, 40], num_heads=6, num_kv_heads=2, block_size=16, head_dim=64, seed=1)
    meta = batch.meta
    write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, meta.slot_mapping)
    args = (batch.q, batch.k_cache, batch.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, batch.scale)
    lacking = [3, *range(kernels.bf16_attention_form() + 1, 3)]
    for dots in lacking:
        with pytest.raises(RuntimeError, match=f"this build or process has no such dot products: {dots}"):
            kernels.paged_prefill_attention(*args, dots)
    torch.testing.assert_close(kernels.paged_prefill_attention(*args, 0), naive_attention(batch), rtol=1e-5, atol=1e-5)


def test_batch_helper_scatters_blocks_and_fills_prefixes() -> None:
    """The helper itself: random non-contiguous tables, and the cache holds each prefix."""
    q_lens, seq_lens = [1, 1, 5, 9], [40, 17, 5, 50]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, block_size=16, seed=5)
    tables = batch.meta.block_tables
    owned = [tables[i, : -(-s // 16)].tolist() for i, s in enumerate(seq_lens)]
    flat = [b for table in owned for b in table]
    assert len(set(flat)) == len(flat), "blocks are shared between sequences"
    jumps = [b - a for table in owned for a, b in itertools.pairwise(table)]
    assert any(jump != 1 for jump in jumps), "block tables are contiguous"
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        cached = batch.k_cache[tables[i]].flatten(0, 1)[: seq_len - q_len]
        torch.testing.assert_close(cached, batch.ctx_k[i][: seq_len - q_len], rtol=0, atol=0)


def test_xformers_context_slots_gather_every_context() -> None:
    from headroom.executor.attention.xformers import context_slots

    q_lens, seq_lens = mixed_lens(random.Random(11), 3, 4, 16)
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, block_size=16, seed=2)
    run(TorchAttention(), batch)  # writes the new k/v
    gathered = batch.k_cache.flatten(0, 1)[context_slots(batch.meta, 16)]
    torch.testing.assert_close(gathered, torch.cat(batch.ctx_k), rtol=0, atol=0)


# Backend selection


def test_on_cpu_our_paged_kernel_then_torch_are_available() -> None:
    assert available_backends(CPU) == ["cpu_paged", "torch"]


def test_auto_picks_the_paged_kernel_on_cpu_and_it_extends_the_reference() -> None:
    backend = select_backend("auto", CPU)
    assert backend.name == "cpu_paged" and isinstance(backend, TorchAttention)
    assert type(select_backend("torch", CPU)) is TorchAttention


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="bogus") as err:
        select_backend("bogus", CPU)
    for choice in ("auto", "torch", "flash_attn", "xformers"):
        assert choice in str(err.value)


@pytest.mark.parametrize("name", ["flash_attn", "xformers"])
def test_gpu_backends_refuse_cpu(name: str) -> None:
    with pytest.raises((ImportError, RuntimeError), match="CUDA"):
        select_backend(name, CPU)


@pytest.mark.parametrize(
    "module,cls,block_size",
    [("flash_attn", "FlashAttention", 256), ("xformers", "XFormersAttention", 16)],
)
def test_gpu_backend_modules_import_without_their_packages(module: str, cls: str, block_size: int) -> None:
    backend = getattr(importlib.import_module(f"headroom.executor.attention.{module}"), cls)
    assert backend.name == module
    assert backend.block_size == block_size


# GPU parity: each backend in half precision against the torch reference in float32.


def gpu_mixed_batch(backend_cls, kind: str, num_heads: int, num_kv_heads: int, seed: int) -> Batch:
    rng = random.Random(seed)
    decodes, prefills = {"mixed": (4, 4), "decode_only": (6, 0), "prefill_only": (0, 4)}[kind]
    q_lens, seq_lens = mixed_lens(rng, decodes, prefills, backend_cls.block_size)
    return make_batch(
        q_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=backend_cls.block_size,
        seed=seed,
        head_dim=128,
    )


def check_gpu_backend(backend, kind: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int) -> None:
    cuda = torch.device("cuda")
    seed = num_heads + num_kv_heads + len(kind)
    batch = gpu_mixed_batch(type(backend), kind, num_heads, num_kv_heads, seed=seed)
    half = batch.to(cuda, dtype)
    # The reference sees the very values the backend sees, rounded to dtype, in float32.
    reference = half.to(cuda, torch.float32)
    before = clone(half)
    out = run(backend, half)
    expected = run(TorchAttention(), reference)
    assert out.dtype == dtype and out.shape == half.q.shape
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert_cache_written(half, before)


GPU_CASES = pytest.mark.parametrize("kind", ["mixed", "decode_only", "prefill_only"])
GPU_HEADS = pytest.mark.parametrize(
    "num_heads,num_kv_heads", [pytest.param(8, 8, id="mha"), pytest.param(8, 2, id="gqa4")]
)


@pytest.mark.gpu
@needs_cuda
@GPU_CASES
@GPU_HEADS
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_flash_attn_matches_torch(kind: str, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    gpu_package("flash_attn")
    from headroom.executor.attention.flash_attn import FlashAttention

    try:
        FlashAttention.check_available(torch.device("cuda"))
    except (ImportError, RuntimeError) as exc:
        gpu_backend_unusable(exc)
    check_gpu_backend(FlashAttention(), kind, dtype, num_heads, num_kv_heads)


@pytest.mark.gpu
@needs_cuda
@GPU_CASES
@GPU_HEADS
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_xformers_matches_torch(kind: str, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    gpu_package("xformers")
    from headroom.executor.attention.xformers import XFormersAttention

    try:
        XFormersAttention.check_available(torch.device("cuda"))
    except (ImportError, RuntimeError) as exc:
        gpu_backend_unusable(exc)
    check_gpu_backend(XFormersAttention(), kind, dtype, num_heads, num_kv_heads)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_torch_on_cuda_matches_cpu(block_size: int) -> None:
    q_lens, seq_lens = mixed_lens(random.Random(5), 3, 4, block_size)
    cpu = make_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=2, block_size=block_size, seed=9)
    cuda = cpu.to(torch.device("cuda"), torch.float32)
    expected = run(TorchAttention(), cpu)
    torch.testing.assert_close(run(TorchAttention(), cuda).cpu(), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cuda.k_cache.cpu(), cpu.k_cache, rtol=0, atol=0)


def test_decode_groups_bound_padding_and_cover_every_row():
    from headroom.executor.attention.torch_ref import decode_groups

    lens = [2000, 40, 300, 45, 2100, 600, 50]
    groups = decode_groups(lens, slack=1.5, min_len=256)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert groups == [[1, 3, 6, 2], [5], [0, 4]]
    for g in groups:
        assert max(lens[i] for i in g) <= 1.5 * max(min(lens[i] for i in g), 256)
