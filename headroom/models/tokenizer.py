"""The model's tokenizer: a Hugging Face fast tokenizer, built offline from GGUF or a checkpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()):
        # `hf` stays public: the incremental detokenizer works on tokens, not just ids.
        self.hf = hf
        eos = set(extra_eos_ids)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        self.eos_token_ids: set[int] = eos
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)

    @classmethod
    def from_gguf(cls, path: str, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GGUF file not found: {path}")
        path = os.path.abspath(path)
        hf = AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True
        )
        return cls(hf, extra_eos_ids)

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory not found: {path}")
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise FileNotFoundError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # Chat models often end a turn with a token other than the tokenizer's eos
        # (Llama 3's <|eot_id|>); the checkpoint lists those in its configs.
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            extra += _eos_ids(os.path.join(path, name))
        return cls(hf, extra)

    def encode(self, text: str) -> list[int]:
        # add_special_tokens follows the tokenizer's own settings (e.g. a BOS for Llama 2).
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (most tool-calling models' do)."""
        return bool(self.hf.chat_template) and "tools" in self.hf.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use the completions API instead")
        text = self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        # The template writes any BOS itself; adding special tokens again would double it.
        return self.hf.encode(text, add_special_tokens=False)


def token_id_list(ids: int | list[int] | None) -> list[int]:
    """HF configs give eos_token_id as an int, a list, or not at all."""
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def _eos_ids(config_path: str) -> list[int]:
    if not os.path.isfile(config_path):
        return []
    with open(config_path, encoding="utf-8") as f:
        return token_id_list(json.load(f).get("eos_token_id"))
