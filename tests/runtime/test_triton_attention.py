"""Our Triton paged-attention kernels against the torch reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1): decode, prefill and chunked prefill, block
sizes 16 and 64, GQA 3:1 and 4:1, random lengths, float32 and bfloat16, and an int8 cache."""

from __future__ import annotations

import random

import pytest
import torch

from headroom.config import SchedulerConfig
from headroom.executor.attention import backend as registry

# tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU; with one, the same
# tests run the compiled kernels on it.
# A plain import: triton is a dev dependency on Linux, so its absence must fail here,
# not skip the interpreter tests (only CUDA may be missing).
from headroom.executor.attention import triton_paged
from headroom.executor.attention.torch_ref import TorchAttention
from tests.runtime.test_attention import CPU, assert_cache_written, clone, make_batch, rounded_to_cache, run

DEVICE = torch.device("cuda") if torch.cuda.is_available() else CPU
pytestmark = pytest.mark.triton

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2}

# The whole-model tests run without the long lane: its start-up timing of three 64-token
# chunks (warmup.py) is most of their kernel launches, and the interpreter's time is in
# launches. Both engines of a comparison run so, and prompts this short fit one step.
NO_LANE = SchedulerConfig(long_lane=False)


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lengths(kind: str, block_size: int, rng: random.Random) -> tuple[list[int], list[int]]:
    decodes = [rng.randint(1, 3 * block_size) for _ in range(3)]
    # Prefill chunks: fresh (no cached prefix) and chunked (a cached prefix, maybe ending
    # mid-block), longer than one query tile so tiles and blocks both cross boundaries.
    q_lens = [rng.randint(2, 40), rng.randint(17, 40), rng.randint(2, 20)]
    prefixes = [0, rng.randint(1, 2 * block_size), rng.randint(1, 3 * block_size)]
    if kind == "decode":
        return [1] * len(decodes), decodes
    if kind == "prefill":
        return q_lens, [p + q for p, q in zip(prefixes, q_lens, strict=True)]
    return [1] * len(decodes) + q_lens, decodes + [p + q for p, q in zip(prefixes, q_lens, strict=True)]


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [pytest.param(6, 2, id="gqa3"), pytest.param(8, 2, id="gqa4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_matches_torch(kind: str, block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype):
    seed = block_size + num_heads + len(kind)
    q_lens, seq_lens = lengths(kind, block_size, random.Random(seed))
    batch = make_batch(
        q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size, seed=seed, head_dim=32
    ).to(DEVICE, dtype)
    # The reference sees the very values the kernel sees (rounded to dtype), in float32.
    reference = batch.to(DEVICE, torch.float32)
    before = clone(batch)
    out = run(triton_paged.TritonAttention(), batch)
    expected = run(TorchAttention(), reference)
    assert out.dtype == dtype and out.shape == batch.q.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    assert_cache_written(batch, before)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
# The small shape, and the default model's head_dim (64) in 64-token blocks: 64-dim loads
# and 64-key prefill tiles over 68-byte rows.
@pytest.mark.parametrize("block_size,head_dim", [(16, 32), (64, 64)], ids=["b16d32", "b64d64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_reads_an_int8_cache_as_the_reference_does(
    kind: str, block_size: int, head_dim: int, dtype: torch.dtype
):
    # Rows of a float32 scale and a byte a dim (kv_rows.py), widened in the kernel to the
    # queries' dtype; the reference reads the same rows in float32.
    seed = len(kind) + block_size
    q_lens, seq_lens = lengths(kind, block_size, random.Random(seed))
    batch = make_batch(
        q_lens, seq_lens, num_heads=6, num_kv_heads=2, block_size=block_size, seed=seed, head_dim=head_dim
    )
    batch = rounded_to_cache(batch, torch.int8).to(DEVICE, dtype)
    reference = batch.to(DEVICE, torch.float32)
    before = clone(batch)
    out = run(triton_paged.TritonAttention(), batch)
    expected = run(TorchAttention(), reference)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    assert_cache_written(batch, before)


class PoisonedParts(triton_paged.TritonAttention):
    """Scratch rows start as NaN, so a merge that reads a row no part wrote shows it."""

    @staticmethod
    def parts_buffer(rows: int, width: int, device: torch.device) -> torch.Tensor:
        return torch.full((rows, width), float("nan"), device=device)


@pytest.mark.parametrize(
    "part,tile",
    [
        pytest.param(None, None, id="default"),
        pytest.param(32, 16, id="small"),
        pytest.param(48, 32, id="ragged"),  # a part's last step is a partial tile
    ],
)
@pytest.mark.parametrize("cache", [None, torch.int8], ids=["cache_as_queries", "cache_int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_decodes_run_in_parts_whose_softmaxes_merge(
    part: int | None, tile: int | None, cache: torch.dtype | None, dtype: torch.dtype
):
    backend = PoisonedParts()
    if part:
        backend.decode_part, backend.decode_tile = part, tile
    part = backend.decode_part
    # One key, a part less one, a whole part, one key over, several parts and a ragged end,
    # with a prefill chunk behind them as a mixed step has; then short decodes beside a long
    # prefill, whose length alone makes the step run in parts.
    for q_lens, seq_lens in (
        ([1, 1, 1, 1, 1, 24], [1, part - 1, part, part + 1, 3 * part + 17, part + 40]),
        ([1, 1, 1, 24], [1, 5, part - 3, 3 * part]),
    ):
        batch = make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, block_size=16, seed=part, head_dim=32)
        if cache is not None:
            batch = rounded_to_cache(batch, cache)
        batch = batch.to(DEVICE, dtype)
        expected = run(TorchAttention(), batch.to(DEVICE, torch.float32))
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(run(backend, batch).float(), expected, rtol=tol, atol=tol)


def test_head_dim_that_is_not_a_power_of_two():
    q_lens, seq_lens = [1, 1, 9], [5, 30, 20]
    batch = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=1, block_size=16, seed=3, head_dim=48).to(
        DEVICE, torch.float32
    )
    expected = run(TorchAttention(), clone(batch))
    torch.testing.assert_close(run(triton_paged.TritonAttention(), batch), expected, rtol=1e-3, atol=1e-3)


# Selection: flash-attn, then Triton, then xformers on CUDA; torch always last.


class Usable:
    @staticmethod
    def check_available(device):
        return None


class Missing:
    @staticmethod
    def check_available(device):
        raise ImportError("not installed")


@pytest.mark.parametrize(
    "installed,expected",
    [
        ({"flash_attn", "triton", "xformers"}, "flash_attn"),
        ({"triton", "xformers"}, "triton"),
        ({"xformers"}, "xformers"),
        (set(), "torch"),
    ],
)
def test_auto_prefers_flash_then_triton_then_xformers_on_cuda(monkeypatch, installed, expected):
    monkeypatch.setattr(registry, "_load", lambda name: Usable if name in installed | {"torch"} else Missing)
    name, reason = registry.choose_backend("auto", torch.device("cuda"))
    assert name == expected
    assert reason.endswith(f"{expected} is the best available")
    for skipped in (
        registry.GPU_PREFERENCE[: registry.GPU_PREFERENCE.index(expected)]
        if expected != "torch"
        else registry.GPU_PREFERENCE
    ):
        assert f"{skipped} unavailable (ImportError: not installed)" in reason


def test_cpu_never_probes_gpu_backends_and_a_flag_overrides():
    assert registry.choose_backend("auto", CPU) == ("cpu_paged", "auto on cpu: cpu_paged is the best available")
    assert registry.choose_backend("triton", CPU) == ("triton", "chosen by --attention-backend")


def test_triton_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        triton_paged.TritonAttention.check_available(CPU)


@pytest.mark.slow
def test_greedy_tokens_through_the_whole_model_equal_torch(default_model):
    from headroom.config import CacheConfig, Config, ModelConfig
    from headroom.contracts.request import SamplingParams
    from headroom.models.loader import load_model
    from headroom.runtime.engine import Engine

    if DEVICE.type == "cuda":
        default_model = load_model(ModelConfig(), DEVICE, torch.float32)

    # Two prompts of different lengths: the first steps are prefill, the rest decode.
    prompts = [
        default_model.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Hi")
    ]
    sampling = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        config = Config(cache=CacheConfig(num_blocks=64, block_size=16), attention_backend=backend, scheduler=NO_LANE)
        engine = Engine(config, loaded=default_model)
        assert engine.executor.backend.name == backend
        outputs[backend] = [r.output_token_ids for r in engine.generate(prompts, sampling)]
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.slow
def test_guessed_tokens_are_verified_through_triton_as_decoding_computes_them(default_model):
    """Speculative decoding's rows (one decode row a guessed position) through the Triton
    kernels: the same tokens as decoding without guesses (through torch's attention, which
    the test above holds Triton's decoding to: the interpreter costs about a second a
    kernel launch, 30 a step), and guesses kept."""
    from headroom.config import CacheConfig, Config, ModelConfig, SpeculativeConfig
    from headroom.contracts.request import SamplingParams
    from headroom.models.loader import load_model
    from headroom.runtime.engine import Engine

    if DEVICE.type == "cuda":
        default_model = load_model(ModelConfig(), DEVICE, torch.float32)
    # Short (the interpreter runs each kernel program in numpy): a text that repeats, so the
    # model's continuation is in its prompt.
    prompts = [default_model.tokenizer.encode("one two three four five six seven eight. one two three four")]
    sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs, kept = {}, {}
    for method, backend in (("off", "torch"), ("ngram", "triton")):
        config = Config(
            cache=CacheConfig(num_blocks=64, block_size=16),
            attention_backend=backend,
            speculative=SpeculativeConfig(method=method),
            scheduler=NO_LANE,
        )
        engine = Engine(config, loaded=default_model)
        if engine.scheduler.speculator is not None:
            engine.scheduler.speculator.priced = False  # guess wherever a row can
        outputs[method] = [r.output_token_ids for r in engine.generate(prompts, sampling)]
        kept[method] = engine.stats.spec_accepted_tokens
    assert outputs["ngram"] == outputs["off"]
    assert kept == {"off": 0, "ngram": kept["ngram"]} and kept["ngram"] > 0
