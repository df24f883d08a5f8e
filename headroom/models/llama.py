"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened, paged batch.

Tokens of all sequences in a step are packed into one (N,) batch; attention reads and
writes the paged KV cache through the backend, so no sequence is padded to another.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from headroom.contracts.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from headroom.models.lora import LoraStep

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        scaling = cfg.get("rope_scaling")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            architecture=arch,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = dict(args.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band
        # between them interpolated smoothly.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (N, H, D); cos/sin: (N, 1, D/2). Rotate-half (NeoX) pairing, as in HF checkpoints.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels: ModuleType | None = None  # see use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm); with the CPU kernels, x is updated in place."""
        if self.kernels is not None:
            return x, self.kernels.add_rms_norm_(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids and positions."""

    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
    backend: AttentionBackend
    # Rows whose residual stream is kept after each layer in hidden_layers (the rows that
    # sample: each sequence's last token), for the length probe.
    hidden_rows: torch.Tensor | None = None
    hidden_layers: frozenset[int] = frozenset()
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    lora: LoraStep | None = None  # the rows that run under LoRA adapters this step


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.index = index  # the layer's, for its LoRA deltas
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size = args.num_heads * args.head_dim
        self.kv_size = args.num_kv_heads * args.head_dim
        self.scale = args.head_dim**-0.5
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.kernels: ModuleType | None = None  # see use_cpu_kernels

    def forward(self, x, cos, sin, kv_cache, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(self.index, "qkv", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.kernels is not None:
            self.kernels.rope_(q, k, cos, sin)
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ctx.backend.forward(q, k, v, kv_cache[0], kv_cache[1], ctx.meta, self.scale).reshape(n, self.q_size)
        projected = self.o_proj(out)
        if ctx.lora is not None:
            ctx.lora.add(self.index, "o", out, projected)
        return projected


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.index = index  # the layer's, for its LoRA deltas
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.kernels: ModuleType | None = None  # see use_cpu_kernels

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add(self.index, "gate_up", x, gate_up)
        if self.kernels is not None:
            h = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        out = self.down_proj(h)
        if lora is not None:
            lora.add(self.index, "down", h, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int):
        super().__init__()
        self.input_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, index)
        self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args, index)

    def forward(self, x, cos, sin, kv_cache, ctx: ForwardContext) -> torch.Tensor:
        x, h = self.post_attn_norm.add_and_norm(x, self.attn(self.input_norm(x), cos, sin, kv_cache, ctx))
        return x + self.mlp(h, ctx.lora)


class Llama(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids, positions: (N,) -> hidden states (N, hidden)
        x = self.embed_tokens(input_ids)
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # (N, D/2)
        cos = freqs.cos().to(x.dtype)[:, None, :]
        sin = freqs.sin().to(x.dtype)[:, None, :]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, ctx.kv_caches, strict=True)):
            x = layer(x, cos, sin, kv_cache, ctx)
            if ctx.hidden_rows is not None and i in ctx.hidden_layers:
                ctx.hidden[i] = x[ctx.hidden_rows]
        return self.norm(x)

    def use_cpu_kernels(self, kernels: ModuleType) -> None:
        """Run RMSNorm, the residual add, RoPE and SiLU * up through headroom's float32 CPU
        kernels: one call each where PyTorch takes several small ops, which at decode sizes
        cost more in dispatch than in arithmetic. Without this the modules run their torch
        code, the reference the kernels are tested against."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: Any, pack: Callable[[nn.Module], None] | None = None) -> None:
        """Load weights named as in HF checkpoints, fusing q/k/v and gate/up. `state` is a
        dict of tensors, or anything whose pop(name) makes the tensor when taken (the loader's
        lazily read file). With pack, each layer is handed to it as soon as it is loaded, and
        the model once whole (its output head is left), so a quantised model never holds all
        its weights in float at once (4 bytes a parameter, eight times its int4 tiles)."""
        get = state.pop
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            own = {
                "input_norm.weight": get(p + "input_layernorm.weight"),
                "post_attn_norm.weight": get(p + "post_attention_layernorm.weight"),
                "attn.qkv_proj.weight": torch.cat([get(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]),
                "attn.o_proj.weight": get(p + "self_attn.o_proj.weight"),
                "mlp.gate_up_proj.weight": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                "mlp.down_proj.weight": get(p + "mlp.down_proj.weight"),
            }
            if self.args.attention_bias:
                own["attn.qkv_proj.bias"] = torch.cat([get(f"{p}self_attn.{n}_proj.bias") for n in "qkv"])
            try:
                layer.load_state_dict(own, strict=True, assign=True)
            except RuntimeError as e:
                raise RuntimeError(f"layer {i}: {e}") from None
            del own  # the float weights go once packed, before the next layer is read
            if pack is not None:
                pack(layer)
        embedding, norm = get("model.embed_tokens.weight"), get("model.norm.weight")
        head = embedding
        if "lm_head.weight" in state and not self.args.tie_word_embeddings:
            head = get("lm_head.weight")
        # A tied model's file may store the head too; it is the embedding, so it is not read.
        unused = [k for k in state if k != "lm_head.weight" and not k.endswith("rotary_emb.inv_freq")]
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}")
        own = {"embed_tokens.weight": embedding, "norm.weight": norm, "lm_head.weight": head}
        # The layers are loaded (and perhaps packed) already: strict=False for their names only.
        missing, unexpected = self.load_state_dict(own, strict=False, assign=True)
        if unexpected or not all(name.startswith("layers.") for name in missing):
            raise RuntimeError(f"weights left unloaded: {missing}, or not the model's: {unexpected}")
        if pack is not None:
            pack(self)
