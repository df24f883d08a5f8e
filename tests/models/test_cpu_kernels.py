"""headroom's C++ CPU kernels against plain torch: the packed linears against a float
matmul over the very weights they were packed from, and paged decode attention against
the torch reference backend (the oracle) on a cache with scattered blocks."""

from __future__ import annotations

import pytest
import torch

from headroom.contracts.attention import AttentionMetadata
from headroom.executor.attention.cpu_paged import CpuPagedAttention
from headroom.executor.attention.torch_ref import TorchAttention
from headroom.kernels import cpu_kernels
from headroom.models.quant import QuantLinear, int4_groups, int8_groups, integer_tiles, pack_q4


def test_the_kernels_build_on_this_machine():
    # CI and every developer machine have a compiler: a failed build must not pass quietly.
    module, why = cpu_kernels()
    assert module is not None, why


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 70])
def test_packed_linear_matches_a_float_matmul_of_its_weights(bits, rows):
    torch.manual_seed(rows)
    weight = torch.randn(200, 96)
    linear = QuantLinear(weight, torch.randn(200), bits, small_batch=128)
    x = torch.randn(rows, 96)
    expected = x @ linear.dequantized().t() + linear.bias
    assert torch.allclose(linear(x), expected, rtol=1e-5, atol=1e-4)


def q4_1_weight(n: int, k: int) -> torch.Tensor:
    """A weight as the default model's file stores it: Q4_1 groups of 32, each spanning
    0..15 (llama.cpp's quantiser maps a group's minimum to 0 and its maximum to 15)."""
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    scale, low = (torch.rand(n, k // 32, 1) * 0.01).half().float(), (torch.randn(n, k // 32, 1) * 0.05).half().float()
    return (q * scale + low).view(n, k)  # Q4_1 holds each group's scale and minimum as float16


def q8_0_weight(n: int, k: int) -> torch.Tensor:
    """A weight as a Q8_0 tensor stores it: each group's largest |q| is 127."""
    q = torch.randint(-127, 128, (n, k // 32, 32))
    q[..., 0] = 127
    return (q.float() * torch.rand(n, k // 32, 1) * 0.001).view(n, k)


@pytest.mark.parametrize("source, with_min", [(q4_1_weight, True), (q8_0_weight, False)])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int8_keeps_the_files_groups_exactly_in_either_form(source, with_min, rows):
    torch.manual_seed(rows)
    weight = source(130, 96)
    linear = QuantLinear(weight, None, 8, small_batch=64)
    assert (linear.mins is not None) == with_min
    assert (linear.dequantized() - weight).abs().max().item() <= 1e-6 * weight.abs().max().item()
    x = torch.randn(rows, 96)
    assert torch.allclose(linear(x), x @ linear.dequantized().t(), rtol=1e-5, atol=1e-5)


def test_above_small_batch_the_float_weight_is_used():
    weight = torch.randn(64, 32)
    linear = QuantLinear(weight, None, 4, small_batch=2)
    x = torch.randn(3, 32)
    assert torch.equal(linear(x), x @ weight.t())
    assert not torch.allclose(linear(x[:2]), x[:2] @ weight.t(), atol=1e-6)  # packed: rounded weights


def test_int4_packing_keeps_q4_1_order_and_values():
    q = torch.arange(32, dtype=torch.uint8).remainder(16).repeat(2, 1)  # two rows, one group each
    packed = pack_q4(q)
    assert packed.shape == (2, 16)
    assert packed[0, 0].item() == (0 | (0 << 4)) and packed[0, 1].item() == (1 | (1 << 4))
    weight = torch.randn(8, 64)
    q4, scale, low = int4_groups(weight)
    assert q4.max() == 15 and q4.min() == 0
    rebuilt = (q4.view(8, 2, 32).float() * scale[..., None] + low[..., None]).view(8, 64)
    assert (rebuilt - weight).abs().max() <= scale.max() / 2 + 1e-6
    q8, scale8 = int8_groups(weight)
    assert (q8.view(8, 2, 32).float() * scale8[..., None]).view(8, 64).sub(weight).abs().max() <= scale8.max() / 2


def scattered_tables(lens: list[int], num_blocks: int, block: int) -> tuple[list[list[int]], torch.Tensor]:
    """Block tables for contexts of these lengths over randomly scattered blocks, as
    lists and as the padded int32 tensor the kernels read."""
    perm = torch.randperm(num_blocks).tolist()
    tables, at = [], 0
    for n in lens:
        need = -(-n // block)
        tables.append(perm[at : at + need])
        at += need
    width = max(len(t) for t in tables)
    return tables, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def test_paged_decode_attention_matches_the_torch_reference():
    torch.manual_seed(0)
    num_blocks, block, hkv, hq, d = 40, 16, 3, 9, 64
    k_cache, v_cache = torch.randn(num_blocks, block, hkv, d), torch.randn(num_blocks, block, hkv, d)
    lens = [1, 15, 16, 17, 100, 250]
    _, table = scattered_tables(lens, num_blocks, block)
    q = torch.randn(len(lens), hq, d)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=1,
        max_seq_len=max(lens),
        num_decodes=len(lens),
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )
    expected = TorchAttention().decode(q, k_cache, v_cache, meta, 0.125)
    got = CpuPagedAttention().decode(q, k_cache, v_cache, meta, 0.125)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def int8_activation_reference(x: torch.Tensor, linear: QuantLinear) -> torch.Tensor:
    """What the integer-dot kernel computes, in plain torch: x rounded per group of 32 to
    int8 (scale = max|x| / 127, round half to even), each group's integer dot product with
    the weight's q scaled by both scales, plus min * scale_x * sum(q_x)."""
    m, k = x.shape
    groups = x.view(m, k // 32, 32)
    dx = groups.abs().amax(-1) / 127
    qx = torch.round(groups / torch.where(dx > 0, dx, 1)[..., None]).clamp(-127, 127)
    w = linear.dequantized()
    qw = ((w.view(w.shape[0], k // 32, 32) - linear.mins[..., None]) / linear.scales[..., None]).round()
    dots = torch.einsum("mgj,ngj->mng", qx.double(), qw.double())
    y = (dots * dx.double()[:, None, :] * linear.scales.double()[None]).sum(-1)
    y += (qx.sum(-1).double() * dx.double()) @ linear.mins.double().t()
    return y.float()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 9, 33])
@pytest.mark.parametrize("shape", [(300, 192), (301, 320)])
def test_linear_of_a_k_multiple_of_64_computes_what_its_path_promises(bits, rows, shape):
    # With AVX2 or AVX-512 VNNI, the integer-dot kernel: exactly the int8-activation
    # arithmetic; elsewhere, the float-activation kernels: a float matmul of the packed weights.
    # (301, 320): 10 groups a row, past a vector of 8 groups' minima, and 301 outputs, one
    # past the kernels' blocks of 4 rows.
    torch.manual_seed(rows)
    n, k = shape
    weight = q4_1_weight(n, k) if bits == 4 else q8_0_weight(n, k)
    linear = QuantLinear(weight, None, bits, small_batch=64)
    kernels, _ = cpu_kernels()
    assert linear.qdot == kernels.qdot_available()
    x = torch.randn(rows, k) * torch.linspace(0.1, 3, k)  # groups of very different ranges
    x[0, :32] = 0  # an all-zero group: scale 0, contributes nothing
    expected = int8_activation_reference(x, linear) if linear.qdot else x @ linear.dequantized().t()
    assert torch.allclose(linear(x), expected, rtol=1e-5, atol=1e-4)
    assert (linear.dequantized() - weight).abs().max().item() <= 1e-6 * weight.abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [5, 6, 7, 8, 9, 10, 11, 40])
def test_batches_above_small_batch_take_the_tiled_kernel_and_the_same_arithmetic(bits, rows):
    # 336 outputs: 21 tiles of 16, so ten pairs and a tile alone; rows 5-11 reach every
    # partial row tile (1-5 rows after whole tiles of 6).
    kernels, _ = cpu_kernels()
    if not kernels.qgemm_available():
        pytest.skip("the tiled integer kernel needs AVX-512 VNNI; this CPU's large batches take a float matmul")
    torch.manual_seed(rows)
    weight = q4_1_weight(336, 192) if bits == 4 else q8_0_weight(336, 192)
    linear = QuantLinear(weight, None, bits, small_batch=4)
    assert linear.tiles is not None and linear.large is None  # no float copy of the weight is kept
    assert linear.tiles[0].numel() == 336 * 192 * bits // 8  # int4 two weights a byte
    assert linear.tiles[1].dtype == linear.tiles[2].dtype == (torch.float16 if bits == 4 else torch.float32)
    x = torch.randn(rows, 192) * torch.linspace(0.1, 3, 192)
    x[1, 64:96] = 0
    expected = int8_activation_reference(x, linear)
    tiled = linear(x)
    assert torch.allclose(tiled, expected, rtol=1e-5, atol=1e-4)
    if bits == 4:  # int4's float16 scales and minima, given as float32: the same values, the same sums
        wide = kernels.qgemm_linear(x, linear.tiles[0], linear.tiles[1].float(), linear.tiles[2].float())
        assert torch.equal(wide, tiled)
    # Row by row through the packed kernel: the same numbers but for float rounding, so a
    # sequence's logits hardly depend on which batch it was in.
    one_by_one = torch.cat([linear(row[None]) for row in x])
    assert torch.allclose(tiled, one_by_one, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tiled, x @ weight.t(), rtol=1e-5, atol=1e-4)  # activations rounded, not float


def test_integer_tiles_lay_out_four_weights_of_16_rows_a_register_and_int4_two_a_byte():
    # qgemm_linear's layouts, checked without the kernel (so on every CPU): byte (tile,
    # group, step, row, i) is weight (16 tile + row, 32 group + 4 step + i); with bits 4,
    # steps s and s + 4 share a byte, s in the low nibble.
    q = torch.randint(0, 16, (32, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scale, low = torch.rand(32, 4).half().float(), torch.rand(32, 4).half().float()  # as int4_groups gives them
    one, scales, mins = integer_tiles(q, scale, low)
    t, g, step, row, i = (torch.arange(n).view(*([1] * d), n, *([1] * (4 - d))) for d, n in enumerate(one.shape))
    assert torch.equal(one, q[16 * t + row, 32 * g + 4 * step + i])
    for by_tile, by_row in ((scales, scale), (mins, low)):
        assert torch.equal(by_tile, by_row.view(2, 16, 4).transpose(1, 2))
    two, *rest = integer_tiles(q, scale, low, bits=4)
    # int4's scales and minima are float16 (Q4_1's own), the same values in the same order.
    assert two.shape == (2, 4, 4, 16, 4) and all(torch.equal(a, b.half()) for a, b in zip(rest, (scales, mins)))
    assert torch.equal(two & 0xF, one[:, :, :4]) and torch.equal(two >> 4, one[:, :, 4:])


@pytest.mark.parametrize("bits", [4, 8])
def test_the_largest_weights_against_the_largest_activations_do_not_saturate(bits):
    # Weights of +-1, so each group's q is at its top (15 for int4, 255 for int8) where w is
    # 1 and at its bottom elsewhere; x of +-1, so its quantised bytes are +-127, the same
    # signs as a weight row's (rows 1 and 2) or all +1 (row 0). Two such products of int8
    # weights are 64,770, past the int16 that AVX2's byte multiply (vpmaddubsw) sums pairs
    # into and saturates at; every path must still give the integer answer.
    signs = torch.randint(0, 2, (64, 128), generator=torch.Generator().manual_seed(0)) * 2 - 1
    weight = signs.float()
    weight[0] = 1
    x = torch.stack([torch.ones(128), weight[3], -weight[5]])
    linear = QuantLinear(weight, None, bits, small_batch=64)
    q = linear.qweight if bits == 8 else torch.cat([linear.qweight & 0xF, linear.qweight >> 4], 1)
    assert q.max().item() == 2**bits - 1
    # The weights as held (int4's float16 scale of 2/15 is not exact), times x: within float
    # rounding of what the integers give, where one saturated pair is off by about 2.
    expected = x @ linear.dequantized().t()
    assert torch.allclose(linear(x), expected, rtol=0, atol=1e-3)


def test_a_shape_the_kernel_does_not_tile_keeps_the_float_matmul():
    weight = q4_1_weight(200, 192)  # 200 outputs: not a whole number of 16-row tiles
    linear = QuantLinear(weight, None, 4, small_batch=2)
    assert linear.tiles is None
    x = torch.randn(3, 192)
    assert torch.allclose(linear(x), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_float_ops_match_the_torch_modules():
    from headroom.models.llama import RMSNorm, apply_rope

    kernels, _ = cpu_kernels()
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96)
    x, delta = torch.randn(7, 96), torch.randn(7, 96)
    fused = RMSNorm(96, 1e-5)
    fused.weight.data, fused.kernels = norm.weight.data, kernels
    assert torch.allclose(fused(x), norm(x), rtol=1e-5, atol=1e-5)
    plain_sum, plain_norm = norm.add_and_norm(x.clone(), delta)
    summed = x.clone()
    fused_sum, fused_norm = fused.add_and_norm(summed, delta)
    assert fused_sum is summed  # updated in place
    assert torch.allclose(fused_sum, plain_sum) and torch.allclose(fused_norm, plain_norm, atol=1e-5)

    gate_up = torch.randn(5, 2 * 40) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)

    qkv = torch.randn(6, (4 + 2 * 2) * 64)  # q, k, v of 4 query and 2 kv heads, as one projection
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k = q.view(6, 4, 64), k.view(6, 2, 64)
    freqs = torch.arange(6)[:, None].float() * torch.rand(32)[None]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kernels.rope_(q, k, cos, sin)  # in place, on views into qkv
    assert torch.allclose(q, want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (5, 1, 128), (4, 4, 32), (10, 2, 64)])
def test_decode_step_writes_this_steps_kv_and_attends_like_the_reference(hq, hkv, d, cache_dtype):
    # d=32 takes the portable path (the tile kernel is for multiples of 64). A 16-bit cache:
    # the kernel must round what it writes as torch's .to() does (the caches are
    # compared exactly) and read it widened to float32, as the reference computes.
    torch.manual_seed(hq * d)
    num_blocks, block = 40, 16
    k_cache = torch.randn(num_blocks, block, hkv, d).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block, hkv, d).to(cache_dtype)
    lens = [1, 16, 17, 250]
    tables, table = scattered_tables(lens, num_blocks, block)
    slots = torch.tensor([t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens)])
    q, k, v = torch.randn(len(lens), hq, d), torch.randn(len(lens), hkv, d), torch.randn(len(lens), hkv, d)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=1,
        max_seq_len=max(lens),
        num_decodes=len(lens),
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = TorchAttention().forward(q, k, v, ref_k, ref_v, meta, d**-0.5)
    got = CpuPagedAttention().forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # the same slots written
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
