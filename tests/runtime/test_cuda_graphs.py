"""Decode through CUDA graphs: which sizes are captured, how a batch is padded, and that
padded rows change nothing a real sequence sees.

Without a GPU the padded forward runs eagerly on the same static buffers a graph would
read, through our Triton kernels in Triton's interpreter; the capture and replay tests
need CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from headroom.config import Config, ConfigError, ModelConfig

# A plain import: triton is a dev dependency on Linux, so its absence must fail here,
# not skip the interpreter tests (only CUDA may be missing).
from headroom.contracts.attention import AttentionMetadata
from headroom.contracts.request import SamplingParams
from headroom.executor.attention import triton_paged
from headroom.executor.cuda_graphs import DecodeGraphs, capture_sizes, padded_size, supports_graphs
from headroom.models.llama import ForwardContext, Llama, ModelArgs
from headroom.runtime.engine import Engine
from tests.gpu import gpu_package

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
BLOCK_SIZE = 16
NUM_BLOCKS = 40  # the pool; block 40 is the padding rows' scratch block
SIZES = (1, 2, 4, 8)
DEFAULT_SIZES = ModelConfig().cuda_graph_sizes


def test_capture_sizes_are_cut_at_max_num_seqs_which_is_always_captured():
    assert capture_sizes(64, DEFAULT_SIZES) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(6, DEFAULT_SIZES) == (1, 2, 4, 6)
    assert capture_sizes(1, DEFAULT_SIZES) == (1,)
    assert capture_sizes(300, DEFAULT_SIZES)[-3:] == (224, 256, 300)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0, DEFAULT_SIZES)


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, None)])
def test_a_batch_pads_up_to_the_next_captured_size(n, expected):
    assert padded_size(n, SIZES) == expected


def test_sizes_from_a_config_file_become_a_sorted_tuple():
    assert ModelConfig(cuda_graph_sizes=[8, 1, 4, 4]).cuda_graph_sizes == (1, 4, 8)
    for bad in ([0, 4], [2.5], "1,2"):
        with pytest.raises(ConfigError, match="cuda_graph_sizes must be a list of positive integers"):
            ModelConfig(cuda_graph_sizes=bad)


def test_only_backends_that_read_device_tensors_alone_are_captured():
    from headroom.executor.attention.torch_ref import TorchAttention

    assert supports_graphs(triton_paged.TritonAttention())
    assert not supports_graphs(TorchAttention())


def test_the_engine_says_why_graphs_are_off_on_the_cpu(default_model):
    engine = Engine(Config(model=ModelConfig(device="cpu")), loaded=default_model)
    assert engine.executor.cuda_graphs == "off (no CUDA graphs on cpu)"
    assert engine.runner.graphs is None
    # No scratch block without graphs: the cache is exactly the pool.
    assert engine.runner.kv_caches[0][0].shape[0] == engine.block_manager.num_blocks


# The padded forward, on static buffers, against the plain eager forward.


def tiny_model(seed: int = 0) -> Llama:
    args = ModelArgs(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Llama(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.to(DEVICE).eval()


def kv_caches(model: Llama, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random contents standing in for earlier steps' keys and values, plus the scratch block."""
    g = torch.Generator().manual_seed(seed)
    a = model.args
    shape = (NUM_BLOCKS + 1, BLOCK_SIZE, a.num_kv_heads, a.head_dim)
    return [
        (torch.randn(shape, generator=g).to(DEVICE), torch.randn(shape, generator=g).to(DEVICE))
        for _ in range(a.num_layers)
    ]


def decode_batch(seq_lens: list[int], rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One new token per sequence at position seq_len - 1, each sequence on its own blocks."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables, slots = [], []
    for n in seq_lens:
        table = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(table)
        slots.append(table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    width = max(map(len, tables))
    b = len(seq_lens)

    def on(t):
        return t.to(DEVICE)

    meta = AttentionMetadata(
        slot_mapping=on(torch.tensor(slots, dtype=torch.int64)),
        query_start_loc=on(torch.arange(b + 1, dtype=torch.int32)),
        seq_start_loc=on(torch.tensor([0, *seq_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)),
        seq_lens=on(torch.tensor(seq_lens, dtype=torch.int32)),
        block_tables=on(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        num_decodes=b,
        query_lens_cpu=[1] * b,
        seq_lens_cpu=list(seq_lens),
    )
    input_ids = on(torch.tensor([rng.randrange(96) for _ in seq_lens], dtype=torch.int64))
    positions = on(torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64))
    return input_ids, positions, meta


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.triton
@torch.inference_mode()
def test_padded_rows_change_nothing_a_real_sequence_sees():
    model = tiny_model()
    backend = triton_paged.TritonAttention()
    caches = kv_caches(model, seed=1)
    graphs = DecodeGraphs(
        model, backend, caches, SIZES, BLOCK_SIZE, max_model_len=256, pad_block=NUM_BLOCKS, device=DEVICE
    )
    rng = random.Random(7)
    # 5 rows pad to 8; then 3 rows pad to 4, over rows the first batch filled; then 1.
    for seq_lens in ([5, 40, 17, 64, 33], [3, 20, 49], [30]):
        input_ids, positions, meta = decode_batch(seq_lens, rng)
        eager_caches = [(k.clone(), v.clone()) for k, v in caches]
        ctx = ForwardContext(meta=meta, kv_caches=eager_caches, backend=backend)
        expected = model(input_ids, positions, ctx)

        hidden = graphs.run(input_ids, positions, meta)

        n, size = len(seq_lens), padded_size(len(seq_lens), SIZES)
        assert hidden.shape == expected.shape
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        for (k, v), (ek, ev) in zip(caches, eager_caches, strict=True):
            # Every block a sequence can own holds what the eager step wrote there.
            torch.testing.assert_close(k[:NUM_BLOCKS], ek[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v[:NUM_BLOCKS], ev[:NUM_BLOCKS], rtol=1e-5, atol=1e-5)
        # The padding rows are one-token contexts in the scratch block, whatever ran before.
        assert graphs.seq_lens[n:size].tolist() == [1] * (size - n)
        assert graphs.slot_mapping[n:size].tolist() == [NUM_BLOCKS * BLOCK_SIZE] * (size - n)
        assert graphs.block_tables[n:size, 0].tolist() == [NUM_BLOCKS] * (size - n)
        assert graphs.seq_start_loc[: n + 1].tolist() == [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
    assert graphs.replays == 0  # nothing was captured: no GPU here, or not asked to


@pytest.mark.triton
def test_only_decode_batches_that_fit_are_run_padded():
    model = tiny_model()
    graphs = DecodeGraphs(
        model,
        triton_paged.TritonAttention(),
        kv_caches(model, seed=2),
        SIZES,
        BLOCK_SIZE,
        max_model_len=256,
        pad_block=NUM_BLOCKS,
        device=DEVICE,
    )
    assert graphs.can_run(num_seqs=8, num_decodes=8)
    assert not graphs.can_run(num_seqs=9, num_decodes=9)
    assert not graphs.can_run(num_seqs=3, num_decodes=2)
    input_ids, positions, meta = decode_batch([4] * 9, random.Random(0))
    with pytest.raises(ValueError, match="9 rows"):
        graphs.run(input_ids, positions, meta)


# On a GPU: capture and replay.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_a_replayed_graph_computes_what_the_same_forward_computes_eagerly():
    # Same padded size, same static buffers, so the same kernels: only the launch differs.
    model = tiny_model()
    graphs = DecodeGraphs(
        model,
        triton_paged.TritonAttention(),
        kv_caches(model, seed=3),
        SIZES,
        BLOCK_SIZE,
        max_model_len=256,
        pad_block=NUM_BLOCKS,
        device=DEVICE,
    )
    graphs.capture()
    assert sorted(graphs.graphs) == list(SIZES)
    rng = random.Random(3)
    for n in (1, 3, 5, 8, 2):  # shrinking after a larger batch re-pads its rows
        # Under 80 tokens: at most 5 blocks a sequence, so 8 fit the pool's 40.
        input_ids, positions, meta = decode_batch([rng.randrange(2, 80) for _ in range(n)], rng)
        replayed = graphs.run(input_ids, positions, meta).clone()
        with torch.inference_mode():
            eager = graphs._forward(padded_size(n, SIZES))[:n]
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
    assert graphs.replays == 5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_graphed_decode_follows_the_eager_tokens(backend):
    if backend == "flash_attn":
        gpu_package("flash_attn")
    from headroom.config import CacheConfig, SchedulerConfig, SpeculativeConfig

    outputs, engines = {}, {}
    for eager in (True, False):
        config = Config(
            model=ModelConfig(device="cuda", dtype="bfloat16", enforce_eager=eager),
            cache=CacheConfig(num_blocks=512 if backend == "triton" else 64),
            scheduler=SchedulerConfig(max_num_seqs=16),
            attention_backend=backend,
            # One token a row a step: the replays below count decode steps of 11 rows.
            speculative=SpeculativeConfig(method="off"),
        )
        engine = Engine(config)
        prompts = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": f"Count to {i}."}]) for i in range(11)
        ]  # 11 rows: padded to 16
        sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outputs[eager] = [r.output_token_ids for r in engine.generate(prompts, sampling)]
        engines[eager] = engine
    assert engines[True].runner.graphs is None and engines[True].executor.cuda_graphs == "off (enforce_eager)"
    graphs = engines[False].runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    assert graphs.replays >= 20  # every decode step after the prefill
    # Padding 11 rows to 16 may change which GEMM kernel runs, so in bf16 a greedy near-tie
    # can break the other way somewhere; a wrong cache or a wrong row breaks every row early.
    assert all(g[:4] == e[:4] for g, e in zip(outputs[False], outputs[True], strict=True))
    assert sum(g == e for g, e in zip(outputs[False], outputs[True], strict=True)) >= 9
