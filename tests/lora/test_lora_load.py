"""Bad adapters get a clear error: every fault load_peft_adapter and LoraRegistry check
is raised as a LoraError whose words name the file or the weight and the fault; a good
adapter is laid out for the fused projections with PEFT's scaling folded in."""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from headroom.config import ConfigError, SchedulerConfig
from headroom.models.lora import LoraError, LoraRegistry, load_peft_adapter

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"

# The default model (SmolLM2-135M): its sizes, written out so that a wrong one in the code fails.
HIDDEN, Q, KV, INTER, LAYERS = 576, 576, 192, 1536, 30


def key(layer: int, module: str, ab: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"{PREFIX}.{layer}.{block}.{module}.lora_{ab}.weight"


@pytest.fixture(scope="module")
def args(default_model):
    a = default_model.args
    assert (a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim) == (HIDDEN, Q, KV)
    assert (a.intermediate_size, a.num_layers) == (INTER, LAYERS)
    return a


def load(name: str, path, args, max_rank: int = 64):
    return load_peft_adapter(name, str(path), args, max_rank, torch.float32, torch.device("cpu"))


def registry(default_model) -> LoraRegistry:
    return LoraRegistry(default_model.args, 64, torch.float32, torch.device("cpu"), default_model.names)


def copy_adapter(adapter_dirs, tmp_path, name: str = "attn-r8"):
    path = tmp_path / name
    shutil.copytree(adapter_dirs[name], path)
    return path


def rewrite_weights(path, change) -> None:
    weights = load_file(os.path.join(path, WEIGHTS))
    change(weights)
    save_file(weights, os.path.join(path, WEIGHTS))


def rewrite_config(path, **settings) -> str:
    config_path = os.path.join(path, CONFIG)
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(settings)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return config_path


def raises(message: str):
    """The exact message, whole."""
    return pytest.raises(LoraError, match=f"^{re.escape(message)}$")


# ---- the folder and its config ------------------------------------------------------------


def test_missing_folder(tmp_path, args):
    path = tmp_path / "nowhere"
    with raises(f"LoRA adapter folder not found: {path}"):
        load("x", path, args)


def test_folder_that_is_not_peft(tmp_path, args):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with raises(f"{tmp_path} is not a PEFT adapter: it needs adapter_config.json and adapter_model.safetensors"):
        load("x", tmp_path, args)


def test_config_without_weights(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    os.remove(path / WEIGHTS)
    with raises(f"{path} is not a PEFT adapter: it needs adapter_config.json and adapter_model.safetensors"):
        load("x", path, args)


def test_config_that_is_not_json(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    (path / CONFIG).write_text("{not json", encoding="utf-8")
    expected = (
        f"{path / CONFIG} could not be read: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    )
    with raises(expected):
        load("x", path, args)


def test_config_that_is_not_an_object(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    (path / CONFIG).write_text("[]", encoding="utf-8")
    with pytest.raises(LoraError, match=f"^{re.escape(str(path / CONFIG))}"):
        load("x", path, args)


def test_peft_type_not_lora(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    config_path = rewrite_config(path, peft_type="IA3")
    with raises(f"{config_path}: peft_type must be LORA, got 'IA3'"):
        load("x", path, args)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"bias": "all"}, "bias"),
        ({"bias": "lora_only"}, "bias"),
        ({"use_dora": True}, "use_dora"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"bias": "all", "use_dora": True, "alpha_pattern": {"q_proj": 4}}, "bias, use_dora, alpha_pattern"),
    ],
)
def test_unsupported_setting(adapter_dirs, tmp_path, args, settings, named):
    path = copy_adapter(adapter_dirs, tmp_path)
    config_path = rewrite_config(path, **settings)
    with raises(f"{config_path}: unsupported LoRA settings: {named}"):
        load("x", path, args)


def test_supported_settings_at_their_defaults_load(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    rewrite_config(path, bias="none", use_dora=False, fan_in_fan_out=False, modules_to_save=None, alpha_pattern={})
    assert load("x", path, args).rank == 8


# ---- the weights --------------------------------------------------------------------------


def test_rank_over_max_rank(adapter_dirs, args):
    with raises("attn-r8: rank 8 is over max_lora_rank=4"):
        load("attn-r8", adapter_dirs["attn-r8"], args, max_rank=4)
    with raises("mlp-r16: rank 16 is over max_lora_rank=15"):
        load("mlp-r16", adapter_dirs["mlp-r16"], args, max_rank=15)
    assert load("mlp-r16", adapter_dirs["mlp-r16"], args, max_rank=16).rank == 16  # the bound itself is allowed


def test_b_of_the_wrong_shape(adapter_dirs, tmp_path, args):
    """v's B given q's height: the message names the layer, the module and both shapes."""
    path = copy_adapter(adapter_dirs, tmp_path)

    def change(w):
        assert w[key(3, "v_proj", "B")].shape == (KV, 8)
        w[key(3, "v_proj", "B")] = torch.ones(Q, 8)

    rewrite_weights(path, change)
    with raises(
        f"x: layer 3 v_proj has A (8, {HIDDEN}) and B ({Q}, 8); the model needs A (r, {HIDDEN}) and B ({KV}, r)"
    ):
        load("x", path, args)


def test_a_of_the_wrong_width(adapter_dirs, tmp_path, args):
    """down_proj's A reads the intermediate size, not the hidden size."""
    path = copy_adapter(adapter_dirs, tmp_path, "mlp-r16")
    rewrite_weights(path, lambda w: w.__setitem__(key(7, "down_proj", "A"), torch.ones(16, HIDDEN)))
    with raises(
        f"x: layer 7 down_proj has A (16, {HIDDEN}) and B ({HIDDEN}, 16); "
        f"the model needs A (r, {INTER}) and B ({HIDDEN}, r)"
    ):
        load("x", path, args)


def test_ranks_of_a_and_b_that_differ(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    rewrite_weights(path, lambda w: w.__setitem__(key(0, "q_proj", "B"), torch.ones(Q, 4)))
    with raises(
        f"x: layer 0 q_proj has A (8, {HIDDEN}) and B ({Q}, 4); the model needs A (r, {HIDDEN}) and B ({Q}, r)"
    ):
        load("x", path, args)


def test_weight_of_three_dimensions(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    rewrite_weights(path, lambda w: w.__setitem__(key(0, "q_proj", "A"), torch.ones(8, HIDDEN, 1)))
    with raises(
        f"x: layer 0 q_proj has A (8, {HIDDEN}, 1) and B ({Q}, 8); the model needs A (r, {HIDDEN}) and B ({Q}, r)"
    ):
        load("x", path, args)


def test_scalar_weight(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    rewrite_weights(path, lambda w: w.__setitem__(key(0, "q_proj", "A"), torch.tensor(1.0)))
    with raises(f"x: layer 0 q_proj has A () and B ({Q}, 8); the model needs A (r, {HIDDEN}) and B ({Q}, r)"):
        load("x", path, args)


def test_rank_zero_module(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)

    def change(w):
        w[key(0, "q_proj", "A")] = torch.ones(0, HIDDEN)
        w[key(0, "q_proj", "B")] = torch.ones(Q, 0)

    rewrite_weights(path, change)
    with pytest.raises(LoraError, match=r"^x: layer 0 q_proj "):
        load("x", path, args)


def test_module_the_model_does_not_have(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    bad = f"{PREFIX}.2.mlp.foo_proj.lora_A.weight"

    def change(w):
        w[bad] = w.pop(key(2, "q_proj", "A"))

    rewrite_weights(path, change)
    with raises(f"x: weight {bad} targets a module this model does not have"):
        load("x", path, args)


def test_lm_head_lora(adapter_dirs, tmp_path, args):
    """lm_head (PEFT's modules_to_save or a LoRA on it) is not served; the first of its
    weights in the file's (sorted) order is the one named."""
    path = copy_adapter(adapter_dirs, tmp_path)

    def change(w):
        w["base_model.model.lm_head.lora_A.weight"] = torch.ones(8, HIDDEN)
        w["base_model.model.lm_head.lora_B.weight"] = torch.ones(49152, 8)

    rewrite_weights(path, change)
    with raises("x: weight base_model.model.lm_head.lora_A.weight targets a module this model does not have"):
        load("x", path, args)


def test_embedding_lora(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    bad = "base_model.model.model.embed_tokens.lora_embedding_A"
    rewrite_weights(path, lambda w: w.__setitem__(bad, torch.ones(8, 49152)))
    with raises(f"x: weight {bad} targets a module this model does not have"):
        load("x", path, args)


def test_module_under_the_wrong_block(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    bad_a, bad_b = (key(2, "q_proj", ab).replace("self_attn", "mlp") for ab in "AB")

    def change(w):
        w[bad_a] = w.pop(key(2, "q_proj", "A"))
        w[bad_b] = w.pop(key(2, "q_proj", "B"))

    rewrite_weights(path, change)
    with raises(f"x: weight {bad_a} targets a module this model does not have"):
        load("x", path, args)


def test_layer_beyond_the_model(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)

    def change(w):
        for ab in "AB":
            w[key(LAYERS, "q_proj", ab)] = w.pop(key(0, "q_proj", ab))

    rewrite_weights(path, change)
    with raises(f"x: weight {key(LAYERS, 'q_proj', 'A')} is for layer 30; the model has 30"):
        load("x", path, args)


def test_last_layer_is_within_the_model(adapter_dirs, args):
    adapter = load("x", adapter_dirs["attn-r8"], args)
    assert {layer for layer, _ in adapter.layers} == set(range(LAYERS))


@pytest.mark.parametrize(("dropped", "kept"), [("B", "A"), ("A", "B")])
def test_half_a_pair(adapter_dirs, tmp_path, args, dropped, kept):
    path = copy_adapter(adapter_dirs, tmp_path)
    rewrite_weights(path, lambda w: w.pop(key(5, "v_proj", dropped)))
    with raises(f"x: layer 5 v_proj has lora_{kept} without its pair"):
        load("x", path, args)


def test_no_lora_weights(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    save_file({}, os.path.join(path, WEIGHTS))
    with raises("x: adapter_model.safetensors holds no LoRA weights"):
        load("x", path, args)


# ---- a good adapter's layout --------------------------------------------------------------


def test_attn_adapter_layout_and_scaling(adapter_dirs, args):
    """attn-r8: r=8, lora_alpha=16 on q and v: each layer's fused qkv stacks A_q over A_v,
    and B holds B_q * 2.0 in q's rows and columns, B_v * 2.0 in v's, zeros elsewhere."""
    path = adapter_dirs["attn-r8"]
    adapter = load("attn-r8", path, args)
    file = load_file(os.path.join(path, WEIGHTS))
    assert adapter.name == "attn-r8"
    assert adapter.path == os.path.abspath(path)
    assert adapter.rank == 8
    assert adapter.targets == ("q_proj", "v_proj")
    assert set(adapter.layers) == {(layer, "qkv") for layer in range(LAYERS)}
    assert adapter.num_parameters == sum(t.numel() for t in file.values())
    for layer in (0, LAYERS - 1):
        fused = adapter.layers[(layer, "qkv")]
        assert fused.a.shape == (16, HIDDEN) and fused.b.shape == (Q + 2 * KV, 16)
        assert fused.a.dtype == fused.b.dtype == torch.float32
        assert torch.equal(fused.a[:8], file[key(layer, "q_proj", "A")])
        assert torch.equal(fused.a[8:], file[key(layer, "v_proj", "A")])
        assert torch.equal(fused.b[:Q, :8], file[key(layer, "q_proj", "B")] * 2.0)
        assert torch.equal(fused.b[Q + KV :, 8:], file[key(layer, "v_proj", "B")] * 2.0)
        assert not fused.b[:Q, 8:].any() and not fused.b[Q : Q + KV].any() and not fused.b[Q + KV :, :8].any()
    # The delta is PEFT's: x @ A.T @ B.T * scaling for q and v, nothing for k.
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    delta = adapter.layers[(0, "qkv")].delta(x)
    q_delta = x @ file[key(0, "q_proj", "A")].t() @ file[key(0, "q_proj", "B")].t() * 2.0
    torch.testing.assert_close(delta[:, :Q], q_delta)
    assert not delta[:, Q : Q + KV].any()


def part_columns(fused, a: torch.Tensor) -> slice:
    """Where a part's A sits among the fused A's rows (its rank columns of B)."""
    r = a.shape[0]
    found = [r0 for r0 in range(fused.a.shape[0] - r + 1) if torch.equal(fused.a[r0 : r0 + r], a)]
    assert len(found) == 1, found
    return slice(found[0], found[0] + r)


def test_rslora_adapter_scaling(adapter_dirs, args):
    """all-r4-rs: rsLoRA, r=4, lora_alpha=8: scaling = 8 / sqrt(4) = 4.0 (not 8 / 4), on
    every projection."""
    path = adapter_dirs["all-r4-rs"]
    adapter = load("all-r4-rs", path, args)
    file = load_file(os.path.join(path, WEIGHTS))
    scaling = 8 / math.sqrt(4)
    assert scaling == 4.0
    assert adapter.rank == 4
    assert adapter.targets == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert set(adapter.layers) == {(layer, p) for layer in range(LAYERS) for p in ("qkv", "o", "gate_up", "down")}
    qkv = adapter.layers[(0, "qkv")]
    assert qkv.a.shape == (12, HIDDEN) and qkv.b.shape == (Q + 2 * KV, 12)
    for module, rows in (("q_proj", slice(0, Q)), ("k_proj", slice(Q, Q + KV)), ("v_proj", slice(Q + KV, None))):
        cols = part_columns(qkv, file[key(0, module, "A")])
        assert torch.equal(qkv.b[rows, cols], file[key(0, module, "B")] * 4.0), module
        others = torch.ones(Q + 2 * KV, dtype=torch.bool)
        others[rows] = False
        assert not qkv.b[others][:, cols].any(), module  # the part's columns are zero outside its rows
    gate_up = adapter.layers[(4, "gate_up")]
    assert gate_up.b.shape == (2 * INTER, 8)
    cols = part_columns(gate_up, file[key(4, "gate_proj", "A")])
    assert torch.equal(gate_up.b[:INTER, cols], file[key(4, "gate_proj", "B")] * 4.0)
    cols = part_columns(gate_up, file[key(4, "up_proj", "A")])
    assert torch.equal(gate_up.b[INTER:, cols], file[key(4, "up_proj", "B")] * 4.0)
    down = adapter.layers[(9, "down")]
    assert torch.equal(down.a, file[key(9, "down_proj", "A")])
    assert torch.equal(down.b, file[key(9, "down_proj", "B")] * 4.0)
    assert torch.equal(adapter.layers[(9, "o")].b, file[key(9, "o_proj", "B")] * 4.0)


def test_mlp_adapter_layout(adapter_dirs, args):
    """mlp-r16: r=16, lora_alpha=32 (scaling 2.0) on the MLP only: no qkv or o deltas."""
    adapter = load("mlp-r16", adapter_dirs["mlp-r16"], args)
    file = load_file(os.path.join(adapter_dirs["mlp-r16"], WEIGHTS))
    assert (adapter.rank, adapter.targets) == (16, ("down_proj", "gate_proj", "up_proj"))
    assert set(adapter.layers) == {(layer, p) for layer in range(LAYERS) for p in ("gate_up", "down")}
    assert torch.equal(adapter.layers[(0, "down")].b, file[key(0, "down_proj", "B")] * 2.0)


def test_dtype_and_device(adapter_dirs, args):
    adapter = load_peft_adapter("x", adapter_dirs["attn-r8"], args, 64, torch.bfloat16, torch.device("cpu"))
    fused = adapter.layers[(0, "qkv")]
    assert fused.a.dtype == fused.b.dtype == torch.bfloat16
    assert fused.a.is_contiguous() and fused.b.is_contiguous()


# ---- the registry -------------------------------------------------------------------------


def test_registry_refuses_a_name_already_loaded(default_model, adapter_dirs):
    loras = registry(default_model)
    ref = loras.load("a", adapter_dirs["attn-r8"])
    with raises("the name 'a' is already taken by a loaded model or adapter"):
        loras.load("a", adapter_dirs["mlp-r16"])
    assert loras.ref("a") == ref
    assert loras.adapters[ref.uid].targets == ("q_proj", "v_proj")  # the first load stands
    assert list(loras.adapters) == [ref.uid]


@pytest.mark.parametrize("which", [0, 1])
def test_registry_refuses_a_base_model_name(default_model, adapter_dirs, which):
    loras = registry(default_model)
    name = default_model.names[which]
    assert name in ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1")
    with raises(f"the name {name!r} is already taken by a loaded model or adapter"):
        loras.load(name, adapter_dirs["attn-r8"])
    assert loras.refs == {} and loras.adapters == {}


def test_registry_refuses_an_empty_name(default_model, adapter_dirs):
    with raises("a LoRA adapter needs a name"):
        registry(default_model).load("", adapter_dirs["attn-r8"])


def test_registry_keeps_nothing_of_a_failed_load(default_model, tmp_path):
    loras = registry(default_model)
    with raises(f"LoRA adapter folder not found: {tmp_path / 'nowhere'}"):
        loras.load("a", str(tmp_path / "nowhere"))
    assert loras.refs == {} and loras.adapters == {} and loras.ref("a") is None


def test_reload_after_unload_gets_a_new_uid(default_model, adapter_dirs):
    loras = registry(default_model)
    first = loras.load("a", adapter_dirs["attn-r8"])
    other = loras.load("b", adapter_dirs["mlp-r16"])
    assert (first.name, first.uid, other.uid) == ("a", 1, 2)
    loras.unload("a")
    assert loras.ref("a") is None and first.uid not in loras.adapters
    second = loras.load("a", adapter_dirs["all-r4-rs"])
    assert (second.name, second.uid) == ("a", 3)
    assert second.key() == b"lora:3" and first.key() == b"lora:1"
    assert second.key() != first.key()
    assert loras.ref("a") == second
    assert loras.adapters[second.uid].rank == 4  # the new weights, not the old
    assert set(loras.adapters) == {other.uid, second.uid}


def test_unload_of_an_unknown_name(default_model):
    with pytest.raises(KeyError):
        registry(default_model).unload("nobody")


# ---- files that are not what they claim -------------------------------------------------------


def test_corrupt_weights_file(adapter_dirs, tmp_path, args):
    path = copy_adapter(adapter_dirs, tmp_path)
    with open(os.path.join(path, WEIGHTS), "r+b") as f:
        f.truncate(100)  # the header claims more bytes than the file holds
    with pytest.raises(LoraError, match=f"^{re.escape(f'x: {WEIGHTS} could not be read: ')}"):
        load("x", path, args)


@pytest.mark.parametrize("alpha", [None, "16", 0, -4, True])
def test_lora_alpha_that_is_not_a_positive_number(adapter_dirs, tmp_path, args, alpha):
    path = copy_adapter(adapter_dirs, tmp_path)
    rewrite_config(path, lora_alpha=alpha)
    with raises(f"x: lora_alpha must be a positive number, got {alpha!r}"):
        load("x", path, args)


def test_a_bad_adapter_in_the_config_stops_the_start_with_a_config_error(default_model, tmp_path):
    from headroom.config import Config
    from headroom.runtime.engine import Engine

    missing = tmp_path / "gone"
    with pytest.raises(ConfigError, match=f"^{re.escape(f'lora: LoRA adapter folder not found: {missing}')}$"):
        Engine(Config(lora=[f"x={missing}"]), loaded=default_model)


def test_weights_beyond_max_cpu_loras_leave_memory_least_recently_used_first(default_model, adapter_dirs):
    loras = LoraRegistry(
        default_model.args, 64, torch.float32, torch.device("cpu"), default_model.names, max_cpu_loras=2
    )
    a, b, c = (loras.load(n, adapter_dirs[n]) for n in ("attn-r8", "mlp-r16", "all-r4-rs"))
    assert list(loras.adapters) == [b.uid, c.uid] and loras.reloads == 0  # a, the oldest, left
    assert set(loras.loaded()) == {"attn-r8", "mlp-r16", "all-r4-rs"}  # still registered, all three
    found, _ = loras.weights([a.uid])
    assert loras.reloads == 1 and list(loras.adapters) == [c.uid, a.uid]  # b, now the oldest, left
    assert found[a.uid].targets == ("q_proj", "v_proj") and found[a.uid] is loras.adapters[a.uid]
    assert loras.weights([c.uid])[0][c.uid] is loras.adapters[c.uid] and loras.reloads == 1  # in memory: no read
    assert list(loras.adapters) == [a.uid, c.uid]  # c used last
    loras.weights([a.uid, b.uid, c.uid])  # a step's own adapters never leave for each other
    assert set(loras.adapters) == {a.uid, b.uid, c.uid} and loras.reloads == 2
    loras.unload("mlp-r16")
    assert not loras.registered(b.uid) and b.uid not in loras.adapters
    loras.running = frozenset({a.uid})  # a runs: a load beyond the cap takes c, used after it
    d = loras.load("again", adapter_dirs["mlp-r16"])
    assert list(loras.adapters) == [a.uid, d.uid] and loras.reloads == 2


def test_max_cpu_loras_below_max_loras_is_refused():
    with pytest.raises(ConfigError, match=r"max_cpu_loras must be >= max_loras, .* \(2 < 4\)"):
        SchedulerConfig(max_loras=4, max_cpu_loras=2)
