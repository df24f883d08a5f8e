"""--quantization auto's choice from the crossover it measures at start, with scripted
timings: the packed mode that costs least against float over batch sizes 1-64, packed
weights up to the batch where the large-batch path overtakes them, and float32 when no
packed mode beats it; and --dtype auto on the CPU, float32 wherever weights are packed."""

from __future__ import annotations

import pytest
import torch

from headroom.config import ConfigError
from headroom.executor import device as device_module
from headroom.executor.device import resolve_dtype, resolve_quantization
from headroom.models.quant import BATCH_SIZES, Crossover

CPU = torch.device("cpu")


def crossover(packed: dict[int, float], large: float) -> Crossover:
    """Float takes 1 s per row at every batch size; the large path `large` of that;
    the packed path packed[m] of it at batch m."""
    return Crossover(
        float_s={m: float(m) for m in BATCH_SIZES},
        packed_s={m: packed[m] * m for m in BATCH_SIZES},
        large_s={m: large * m for m in BATCH_SIZES},
    )


# int4 packed: 0.3 of float up to batch 16, then 2x float; the large path 0.9 of float.
INT4 = crossover({1: 0.3, 4: 0.3, 16: 0.3, 32: 2.0, 64: 2.0}, large=0.9)  # relative (0.9 + 3 * 0.3 + 2 * 0.9)/5
# int8 packed: 0.6 of float up to batch 4; the large path 0.95.
INT8 = crossover({1: 0.6, 4: 0.6, 16: 1.5, 32: 1.5, 64: 1.5}, large=0.95)
# Slower than float everywhere.
SLOW = crossover(dict.fromkeys(BATCH_SIZES, 1.5), large=1.2)


@pytest.fixture
def measured(monkeypatch):
    """Scripts the start-up measurement: bits -> Crossover; records the shapes asked for."""
    asked = []
    timings: dict[int, Crossover] = {}

    def measure(in_features, out_features, bits, large_dtype):
        asked.append((in_features, out_features, bits, large_dtype))
        return timings[bits]

    monkeypatch.setattr(device_module, "measure_crossover", measure)
    monkeypatch.setattr(device_module, "cpu_kernels", lambda: (object(), "the AVX2 kernels"))
    monkeypatch.setattr(device_module, "large_batch_dtype", lambda _: (torch.float32, "float32 matmuls"))
    return timings, asked


def test_scripted_crossovers_have_the_costs_and_batches_they_script():
    assert INT4.relative_cost == pytest.approx((0.3 * 3 + 0.9 * 2) / 5)
    assert INT8.relative_cost == pytest.approx((0.6 * 2 + 0.95 * 3) / 5)
    assert SLOW.relative_cost == pytest.approx(1.2)
    assert (INT4.small_batch, INT8.small_batch, SLOW.small_batch) == (16, 4, 0)


def test_auto_takes_the_cheaper_packed_mode_up_to_its_crossover(measured):
    timings, asked = measured
    timings.update({4: INT4, 8: INT8})
    mode, small_batch, large, why = resolve_quantization("auto", CPU, torch.float32, 576, 1536)
    assert (mode, small_batch, large) == ("int4", 16, torch.float32)
    assert why.startswith("auto: fastest against the float matmuls over batch sizes 1-64 (the AVX2 kernels; int4 ")
    assert "packed up to batch 16" in why and "packed up to batch 4" in why
    # The gate/up projection (hidden -> 2 x intermediate) stands for the layer's linears.
    assert asked == [(576, 3072, 4, torch.float32), (576, 3072, 8, torch.float32)]


def test_auto_takes_int8_where_it_is_the_cheaper(measured):
    timings, _ = measured
    timings.update({4: SLOW, 8: INT8})
    assert resolve_quantization("auto", CPU, torch.float32, 576, 1536)[:2] == ("int8", 4)


def test_auto_keeps_float32_where_no_packed_mode_beats_it(measured):
    timings, _ = measured
    timings.update({4: SLOW, 8: SLOW})
    mode, small_batch, large, why = resolve_quantization("auto", CPU, torch.float32, 576, 1536)
    assert (mode, small_batch, large) == ("none", 0, torch.float32)
    assert why.startswith("auto: no packed kernel beats float32 here (the AVX2 kernels; int4 ")


def test_a_named_mode_is_kept_even_where_it_loses(measured):
    timings, asked = measured
    timings.update({8: SLOW})
    mode, small_batch, _, why = resolve_quantization("int8", CPU, torch.float32, 576, 1536)
    assert (mode, small_batch) == ("int8", 1)  # never 0: batch 1 always takes the packed weights
    assert why.startswith("chosen by flag or config (") and [bits for *_, bits, _ in asked] == [8]


def test_auto_is_none_off_the_float32_cpu_path_and_measures_nothing(measured):
    _, asked = measured
    mode, small_batch, _, why = resolve_quantization("auto", CPU, torch.bfloat16, 576, 1536)
    assert (mode, small_batch) == ("none", 0)
    assert why == "auto: quantised linears are for float32 on the CPU, not torch.bfloat16 on cpu"
    with pytest.raises(ConfigError, match="^quantization int4 runs on the CPU with dtype float32 only$"):
        resolve_quantization("int4", CPU, torch.bfloat16, 576, 1536)
    assert asked == []


def test_auto_dtype_on_the_cpu_is_float32_for_packed_weights_even_with_amx(monkeypatch):
    # The packed weights' kernels take float32 activations: an AMX CPU once got bfloat16
    # and so no packed weights at all (a third of int4's tokens/s at one stream).
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setattr(device_module, "cpu_kernels", lambda: (object(), "the VNNI kernels"))
    assert resolve_dtype("auto", CPU, "auto") == resolve_dtype("auto", CPU, "int4") == torch.float32
    assert resolve_dtype("auto", CPU, "none") == torch.bfloat16  # nothing packed: AMX's bfloat16 matmuls
    assert resolve_dtype("float32", CPU, "none") == torch.float32
    monkeypatch.setattr(device_module, "cpu_kernels", lambda: (None, "build failed"))
    assert resolve_dtype("auto", CPU, "auto") == torch.bfloat16  # nothing can be packed
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", CPU, "none") == resolve_dtype("auto", CPU, "auto") == torch.float32
    assert resolve_dtype("bfloat16", CPU, "auto") == torch.bfloat16
