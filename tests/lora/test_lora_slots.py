"""The max_loras slots: a step whose adapters fit them runs every adapter in one call of
headroom's CPU kernel per projection, or, without it and where the rows are even, in one
batched matmul, and either gives what each adapter's own matmuls give; slots are reused
least recently used first, widened for a larger rank without losing what they hold, and
emptied on unload; a step they cannot serve falls back to the groups."""

from __future__ import annotations

import pytest
import torch

from headroom.kernels import cpu_kernels
from headroom.models.lora import PROJECTIONS, LoraRegistry, LoraSlots, SlotRows
from tests.lora.conftest import ADAPTERS


def registry(default_model, adapter_dirs, max_loras: int, kernels=None) -> LoraRegistry:
    loras = LoraRegistry(
        default_model.args,
        64,
        torch.float32,
        torch.device("cpu"),
        default_model.names,
        max_loras=max_loras,
        kernels=kernels,
    )
    for name in ADAPTERS:
        loras.load(name, adapter_dirs[name])
    return loras


def widths(args) -> dict[str, tuple[int, int]]:
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}


def expected(loras: LoraRegistry, plan, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
    """Each row's delta from its own adapter's weights, one row at a time."""
    out = torch.zeros(x.shape[0], widths(loras.args)[projection][1])
    row = 0
    for name, n in plan:
        if name is not None:
            fused = loras.adapters[loras.ref(name).uid].layers.get((layer, projection))
            if fused is not None:
                for i in range(row, row + n):
                    out[i] = (x[i] @ fused.a.t()) @ fused.b.t()
        row += n
    return out


def run(step, loras, layer, projection, rows):
    torch.manual_seed(layer)
    x = torch.randn(rows, widths(loras.args)[projection][0])
    out = torch.zeros(rows, widths(loras.args)[projection][1])
    step.add(layer, projection, x, out)
    return x, out


# Decode: one row per sequence, the three adapters and the base interleaved.
DECODE = [(name, 1) for _ in range(4) for name in [*ADAPTERS, None]]


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_padded_step_equals_each_adapter_alone(default_model, adapter_dirs, layer):
    loras = registry(default_model, adapter_dirs, max_loras=8)
    step = loras.step([(loras.ref(n) if n else None, k) for n, k in DECODE])
    assert step.padded is not None and (step.padded.width, step.padded.depth) == (3, 4)
    for projection in PROJECTIONS:
        x, out = run(step, loras, layer, projection, len(DECODE))
        want = expected(loras, DECODE, layer, projection, x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert out[3::4].abs().max().item() == 0.0  # base rows untouched
        assert out.abs().max().item() > 0.0


def test_a_prefill_chunk_runs_alone_and_the_decodes_together(default_model, adapter_dirs):
    """A 40-token chunk under one adapter beside single decode rows of the others: padding
    every slot to 40 rows would be ~30x the decodes' work, so the chunk keeps its own group."""
    loras = registry(default_model, adapter_dirs, max_loras=8)
    plan = [("attn-r8", 40), ("mlp-r16", 1), ("all-r4-rs", 1), (None, 2)]
    step = loras.step([(loras.ref(n) if n else None, k) for n, k in plan])
    [(alone, rows)] = step.groups
    assert alone.name == "attn-r8" and rows.tolist() == list(range(40))
    assert (step.padded.width, step.padded.depth) == (2, 1) and step.padded.rows.tolist() == [40, 41]
    for projection in PROJECTIONS:
        x, out = run(step, loras, 5, projection, 44)
        torch.testing.assert_close(out, expected(loras, plan, 5, projection, x), rtol=1e-5, atol=1e-5)


def test_one_chunk_beside_one_decode_runs_group_by_group(default_model, adapter_dirs):
    loras = registry(default_model, adapter_dirs, max_loras=8)
    plan = [("mlp-r16", 1), ("all-r4-rs", 30)]
    step = loras.step([(loras.ref(n) if n else None, k) for n, k in plan])
    assert step.padded is None and [a.name for a, _ in step.groups] == ["mlp-r16", "all-r4-rs"]
    for projection in PROJECTIONS:
        x, out = run(step, loras, 9, projection, 31)
        torch.testing.assert_close(out, expected(loras, plan, 9, projection, x), rtol=1e-5, atol=1e-5)


def test_more_adapters_than_slots_run_group_by_group(default_model, adapter_dirs):
    loras = registry(default_model, adapter_dirs, max_loras=2)
    step = loras.step([(loras.ref(n) if n else None, k) for n, k in DECODE])
    assert step.padded is None and len(step.groups) == 3
    assert loras.slots.uids == [None, None]  # nothing written for a step it cannot serve
    for projection in PROJECTIONS:
        x, out = run(step, loras, 3, projection, len(DECODE))
        torch.testing.assert_close(out, expected(loras, DECODE, 3, projection, x), rtol=1e-5, atol=1e-5)


def test_slots_reuse_least_recently_used_and_clear_what_the_newcomer_lacks(default_model, adapter_dirs):
    loras = registry(default_model, adapter_dirs, max_loras=2)
    uid = {name: loras.ref(name).uid for name in ADAPTERS}
    adapter = {name: loras.adapters[uid[name]] for name in ADAPTERS}
    slots = loras.slots
    assert slots.place([(uid["all-r4-rs"], adapter["all-r4-rs"]), (uid["mlp-r16"], adapter["mlp-r16"])]) == [0, 1]
    assert slots.place([(uid["mlp-r16"], adapter["mlp-r16"])]) == [1]  # all-r4-rs is now the older
    assert slots.place([(uid["attn-r8"], adapter["attn-r8"]), (uid["mlp-r16"], adapter["mlp-r16"])]) == [0, 1]
    assert slots.uids == [uid["attn-r8"], uid["mlp-r16"]]
    # attn-r8 in slot 0: its q/v weights, and zeros where all-r4-rs had o, gate_up and down.
    fused = adapter["attn-r8"].layers[(2, "qkv")]
    r = fused.a.shape[0]
    assert torch.equal(slots.a[(2, "qkv")][0, :, :r], fused.a.t())
    assert torch.equal(slots.b[(2, "qkv")][0, :r], fused.b.t())
    for projection in ("o", "gate_up", "down"):
        assert slots.a[(2, projection)][0].abs().max().item() == 0.0
        assert slots.b[(2, projection)][0].abs().max().item() == 0.0
    # mlp-r16 in slot 1 untouched by either write.
    down = adapter["mlp-r16"].layers[(2, "down")]
    assert torch.equal(slots.a[(2, "down")][1, :, : down.a.shape[0]], down.a.t())
    # all-r4-rs back over attn-r8 (now the older): its 12 qkv ranks, zeros where attn-r8 had 16.
    assert slots.place([(uid["mlp-r16"], adapter["mlp-r16"])]) == [1]
    assert slots.place([(uid["all-r4-rs"], adapter["all-r4-rs"])]) == [0]
    small = adapter["all-r4-rs"].layers[(2, "qkv")]
    assert (small.a.shape[0], slots.a[(2, "qkv")].shape[2]) == (12, 16)
    assert torch.equal(slots.a[(2, "qkv")][0, :, :12], small.a.t())
    assert slots.a[(2, "qkv")][0, :, 12:].abs().max().item() == 0.0
    assert slots.b[(2, "qkv")][0, 12:].abs().max().item() == 0.0


def test_a_wider_rank_widens_the_stack_and_keeps_what_it_holds(default_model, adapter_dirs):
    loras = registry(default_model, adapter_dirs, max_loras=2)
    small, large = loras.adapters[loras.ref("all-r4-rs").uid], loras.adapters[loras.ref("mlp-r16").uid]
    slots = loras.slots
    slots.place([(1, small)])
    assert slots.a[(0, "down")].shape == (1, 1536, 4)  # only the slots in use are allocated
    slots.place([(1, small), (2, large)])
    assert slots.a[(0, "down")].shape == (2, 1536, 16) and slots.b[(0, "down")].shape == (2, 16, 576)
    assert slots.spans[(0, "down")].shape == (2, 16, 2)
    assert slots.spans[(0, "down")][0, :4].tolist() == [[0, 576]] * 4  # down's one part, all its columns
    assert slots.spans[(0, "down")][0, 4:].abs().max().item() == 0  # the ranks small lacks
    kept = small.layers[(0, "down")]
    assert torch.equal(slots.a[(0, "down")][0, :, :4], kept.a.t())
    assert slots.a[(0, "down")][0, :, 4:].abs().max().item() == 0.0
    assert torch.equal(slots.b[(0, "down")][0, :4], kept.b.t())


def test_a_projection_first_placed_in_a_low_slot_serves_a_step_with_a_higher_one(default_model, adapter_dirs, kernels):
    """attn-r8 twice (slots 0 and 1, qkv only), then mlp-r16 over slot 0 creates the MLP
    stacks; a step of mlp-r16 beside the second attn-r8 in slot 1 reads those stacks at
    slot 1 too, which must exist (as zeros)."""
    loras = registry(default_model, adapter_dirs, max_loras=2, kernels=kernels)
    twin = loras.load("attn-twin", adapter_dirs["attn-r8"])
    loras.step([(loras.ref("attn-r8"), 1)])
    loras.step([(loras.ref("attn-r8"), 1), (twin, 1)])
    plan = [("mlp-r16", 2), ("attn-twin", 1)]
    step = loras.step([(loras.ref(n), k) for n, k in plan])
    assert loras.slots.uids == [loras.ref("mlp-r16").uid, twin.uid]
    assert {a.shape[0] for a in loras.slots.a.values()} == {2}
    for projection in PROJECTIONS:
        x, out = run(step, loras, 4, projection, 3)
        torch.testing.assert_close(out, expected(loras, plan, 4, projection, x), rtol=1e-5, atol=1e-5)


def test_warm_writes_the_adapters_so_that_the_first_steps_allocate_nothing(default_model, adapter_dirs):
    loras = registry(default_model, adapter_dirs, max_loras=2)
    loras.warm()  # the two loaded last, as many as the slots
    assert loras.slots.uids == [loras.ref("mlp-r16").uid, loras.ref("all-r4-rs").uid]
    stacks = {key: (a.data_ptr(), loras.slots.b[key].data_ptr()) for key, a in loras.slots.a.items()}
    step = loras.step([(loras.ref("all-r4-rs"), 1), (loras.ref("mlp-r16"), 2)])
    assert {key: (a.data_ptr(), loras.slots.b[key].data_ptr()) for key, a in loras.slots.a.items()} == stacks
    plan = [("all-r4-rs", 1), ("mlp-r16", 2)]
    for projection in PROJECTIONS:
        x, out = run(step, loras, 5, projection, 3)
        torch.testing.assert_close(out, expected(loras, plan, 5, projection, x), rtol=1e-5, atol=1e-5)


def test_an_adapter_loaded_at_run_time_is_written_in_before_its_first_step(default_model, adapter_dirs, cpp):
    """Into a free slot where there is one; where every slot is in use, the stacks are
    widened for its rank and projections at once. Either way its first step allocates nothing."""
    loras = registry(default_model, adapter_dirs, max_loras=2, kernels=cpp)
    loras.unload("all-r4-rs")
    loras.step([(loras.ref("attn-r8"), 1)])  # attn-r8 in slot 0; the MLP stacks do not exist yet
    wide = loras.load("wide", adapter_dirs["mlp-r16"])
    loras.warm_loaded(wide.uid)
    assert loras.slots.uids == [loras.ref("attn-r8").uid, wide.uid]

    def stacks():
        return {key: (a.data_ptr(), loras.slots.b[key].data_ptr()) for key, a in loras.slots.a.items()}

    before = stacks()
    plan = [("attn-r8", 2), ("wide", 1)]
    step = loras.step([(loras.ref(n), k) for n, k in plan])
    assert stacks() == before
    for projection in PROJECTIONS:
        x, out = run(step, loras, 3, projection, 3)
        torch.testing.assert_close(out, expected(loras, plan, 3, projection, x), rtol=1e-5, atol=1e-5)
    # Both slots in use: the next one (rank 4, every projection) widens nothing it would need
    # at its first step over the least recently used slot.
    late = loras.load("late", adapter_dirs["all-r4-rs"])
    loras.warm_loaded(late.uid)
    assert late.uid not in loras.slots.uids
    before = stacks()
    plan = [("wide", 1), ("late", 2)]
    step = loras.step([(loras.ref(n), k) for n, k in plan])
    assert stacks() == before and loras.slots.uids == [late.uid, wide.uid]
    for projection in PROJECTIONS:
        x, out = run(step, loras, 3, projection, 3)
        torch.testing.assert_close(out, expected(loras, plan, 3, projection, x), rtol=1e-5, atol=1e-5)


def test_unload_empties_the_slot(default_model, adapter_dirs):
    loras = registry(default_model, adapter_dirs, max_loras=8)
    loras.step([(loras.ref(n) if n else None, k) for n, k in DECODE])
    gone = loras.ref("mlp-r16").uid
    assert gone in loras.slots.uids
    loras.unload("mlp-r16")
    assert gone not in loras.slots.uids and gone not in loras.slots.last_used
    assert loras.slots.uids.count(None) == 6


def test_place_refuses_more_than_capacity():
    assert LoraSlots(1).place([(1, None), (2, None)]) is None


@pytest.fixture(scope="module")
def cpp():
    module, why = cpu_kernels()
    assert module is not None, why  # test_cpu_kernels: every machine that tests has a compiler
    return module


# A CUDA machine runs Triton on its tensors; without one, tests/conftest.py selects Triton's
# interpreter, which runs it on the CPU's.
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
INTERPRETED_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the registry here is on the CPU: on CUDA the bfloat16 test runs Triton"
)


# The C++ kernel (float32 on the CPU) and the Triton one (the GPU's; here through Triton's
# interpreter) take the same call.
@pytest.fixture(scope="module", params=["c++", pytest.param("triton", marks=[pytest.mark.triton, INTERPRETED_ONLY])])
def kernels(request, cpp):
    if request.param == "c++":
        return cpp
    from headroom.kernels import lora_triton

    return lora_triton


# The kernel pads nothing, so uneven groups, a prefill chunk and odd row counts all run in
# its one call; all-r4-rs's ranks (qkv 12, down 4) are not whole registers.
KERNEL_PLANS = {
    "decode": DECODE,
    "chunk beside decodes": [("attn-r8", 40), ("mlp-r16", 1), ("all-r4-rs", 1), (None, 2)],
    "one decode beside a chunk": [("mlp-r16", 1), ("all-r4-rs", 30)],
    "odd groups": [("all-r4-rs", 3), (None, 1), ("attn-r8", 5), ("mlp-r16", 1), ("all-r4-rs", 2)],
}


@pytest.mark.parametrize("plan", KERNEL_PLANS.values(), ids=KERNEL_PLANS.keys())
@pytest.mark.parametrize("layer", [0, 29])
def test_the_kernel_step_equals_each_adapter_alone(default_model, adapter_dirs, kernels, plan, layer):
    loras = registry(default_model, adapter_dirs, max_loras=8, kernels=kernels)
    step = loras.step([(loras.ref(n) if n else None, k) for n, k in plan])
    assert step.groups == [] and isinstance(step.padded, SlotRows)
    rows = sum(n for _, n in plan)
    for projection in PROJECTIONS:
        x, out = run(step, loras, layer, projection, rows)
        want = expected(loras, plan, layer, projection, x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert out.abs().max().item() > 0.0
        row = 0
        for name, n in plan:
            if name is None:
                assert out[row : row + n].abs().max().item() == 0.0  # base rows untouched
            row += n


def test_the_kernel_step_with_more_adapters_than_slots_runs_group_by_group(default_model, adapter_dirs, kernels):
    loras = registry(default_model, adapter_dirs, max_loras=2, kernels=kernels)
    step = loras.step([(loras.ref(n) if n else None, k) for n, k in DECODE])
    assert step.padded is None and len(step.groups) == 3
    for projection in PROJECTIONS:
        x, out = run(step, loras, 3, projection, len(DECODE))
        torch.testing.assert_close(out, expected(loras, DECODE, 3, projection, x), rtol=1e-5, atol=1e-5)


def test_the_kernel_adds_into_strided_rows_and_refuses_bad_indices(cpp):
    kernels = cpp
    torch.manual_seed(0)
    a, b = torch.randn(3, 20, 13), torch.randn(3, 13, 37)
    spans = torch.tensor([0, 37]).repeat(3, 13, 1)  # every row of every B may reach every column
    x = torch.randn(6, 20)
    wide = torch.randn(6, 50)
    out, before = wide[:, 5:42], wide.clone()  # rows 50 floats apart
    rows, starts, slots = torch.tensor([4, 0, 2, 5]), torch.tensor([0, 1, 4]), torch.tensor([2, 0])
    kernels.lora_add_(out, x, a, b, spans, rows, starts, slots)
    want = before[:, 5:42].clone()
    want[4] += x[4] @ a[2] @ b[2]
    for i in (0, 2, 5):
        want[i] += x[i] @ a[0] @ b[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 42:], before[:, 42:])
    with pytest.raises(RuntimeError, match="row 6 is outside the batch"):
        kernels.lora_add_(out, x, a, b, spans, torch.tensor([6, 0, 2, 5]), starts, slots)
    with pytest.raises(RuntimeError, match="row 0 is in more than one group"):
        kernels.lora_add_(out, x, a, b, spans, torch.tensor([0, 0, 2, 5]), starts, slots)
    with pytest.raises(RuntimeError, match="group 1: bad start or slot"):
        kernels.lora_add_(out, x, a, b, spans, rows, starts, torch.tensor([2, 3]))
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        kernels.lora_add_(out, x, a, b[:, :, :36].contiguous(), spans, rows, starts, slots)
    with pytest.raises(RuntimeError, match="spans must be a contiguous int64 .S, R, 2. tensor"):
        kernels.lora_add_(out, x, a, b, spans[:, :12].contiguous(), rows, starts, slots)


def test_the_kernel_skips_b_outside_the_spans_and_a_past_the_rank(cpp):
    """A fused B is block-placed and a slot may be wider than its adapter. The expand skips
    a row of B in every block of 32 columns (then each column past the last block) that its
    span misses, and the shrink stops at the slot's last row with a span: NaN in all those
    places must not reach the output (any read of one would)."""
    torch.manual_seed(1)
    a, b = torch.randn(2, 24, 40), torch.randn(2, 40, 70)
    spans = torch.zeros(2, 40, 2, dtype=torch.int64)
    nan = float("nan")
    parts = [  # slot, rank rows, span, B's columns that are skipped, B's zeros that are read
        (0, slice(0, 8), (0, 32), [slice(32, 70)], []),
        (0, slice(8, 12), (48, 59), [slice(0, 32), slice(64, 70)], [slice(32, 48), slice(59, 64)]),
        (0, slice(12, 20), (59, 70), [slice(0, 32)], [slice(32, 59)]),
        (1, slice(0, 4), (3, 67), [], [slice(0, 3), slice(67, 70)]),  # rank 4, edges inside blocks
    ]
    clean_a, clean_b = a.clone(), b.clone()
    for slot, ranks, span, skipped, zeros in parts:
        spans[slot, ranks] = torch.tensor(span)
        for cols in skipped:
            b[slot, ranks, cols], clean_b[slot, ranks, cols] = nan, 0.0
        for cols in zeros:
            b[slot, ranks, cols] = clean_b[slot, ranks, cols] = 0.0
    b[0, 20:] = b[1, 4:] = nan  # rows with no span
    a[0, :, 20:] = a[1, :, 4:] = nan  # rank columns past the slot's adapter
    clean_b[0, 20:] = clean_b[1, 4:] = clean_a[0, :, 20:] = clean_a[1, :, 4:] = 0.0
    x = torch.randn(9, 24)
    out = torch.zeros(9, 70)
    rows, starts, slots = torch.tensor([0, 1, 2, 3, 4, 8, 5, 6]), torch.tensor([0, 5, 8]), torch.tensor([0, 1])
    cpp.lora_add_(out, x, a, b, spans, rows, starts, slots)
    want = torch.zeros(9, 70)
    for g, s in enumerate(slots.tolist()):
        for i in rows[starts[g] : starts[g + 1]].tolist():
            want[i] = x[i] @ clean_a[s] @ clean_b[s]
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert out[7].abs().max().item() == 0.0 and out[0].abs().max().item() > 0.0


@pytest.mark.triton
def test_the_triton_kernel_adds_in_bfloat16_into_strided_rows():
    """The GPU's dtype: bf16 weights and rows, the sums in float32, the shrunk rows rounded
    to bf16 before the expand (as torch's bmm of the padded path does); a group of more
    rows than one program takes, rows of no group and columns outside out left alone.
    On CUDA this runs the kernel's bf16 dots; the interpreter computes wrong bf16 dots, so
    there the kernel converts the tiles to float32 first (DOT_FP32) and this checks the
    rest: the tiles, the masks, the rounding and the stores."""
    from headroom.kernels import lora_triton

    torch.manual_seed(0)
    a, b = (torch.randn(3, 40, 13) / 4).bfloat16(), (torch.randn(3, 13, 70) / 4).bfloat16()
    x = torch.randn(40, 40).bfloat16()
    wide = torch.randn(40, 90).bfloat16()
    before = wide.clone()
    others = [i for i in range(39, -1, -1) if i not in (7, 30, 1, 12)]
    groups = {2: [7], 0: [30, 1, 12], 1: others[:33]}  # 33 rows: three programs; 3 rows in none
    rows = torch.tensor([i for r in groups.values() for i in r])
    starts = torch.tensor([0, 1, 4, 37])
    spans = torch.tensor([0, 70]).repeat(3, 13, 1)
    on = wide.to(DEVICE)
    lora_triton.lora_add_(
        on[:, 5:75],  # rows 90 apart
        *(t.to(DEVICE) for t in (x, a, b, spans, rows, starts, torch.tensor(list(groups)))),
    )
    wide = on.cpu()
    want = before[:, 5:75].float()
    for slot, members in groups.items():
        for i in members:
            t = (x[i].float() @ a[slot].float()).bfloat16().float()
            want[i] += t @ b[slot].float()
    torch.testing.assert_close(wide[:, 5:75], want.bfloat16(), rtol=1.6e-2, atol=1e-2)
    untouched = sorted(set(range(40)) - set(rows.tolist()))
    assert untouched and torch.equal(wide[untouched], before[untouched])
    assert torch.equal(wide[:, :5], before[:, :5]) and torch.equal(wide[:, 75:], before[:, 75:])
