"""Structured output: grammars compiled by xgrammar (the engine vLLM and SGLang use),
applied as a token bitmask to the logits of the sequences that carry one.

A request's GrammarSpec (a JSON schema, any JSON, a regex, a list of choices) is compiled
once per distinct spec, off the event loop and outside the engine's step (the server
calls `compile` in a worker thread; xgrammar caches what it compiled). Each sequence then
gets its own matcher: on the engine thread, the sampler fills the batch's bitmask from
the matchers, masks the logits, samples, and advances each matcher by its token. When
the grammar is complete it allows only the end-of-sequence tokens, so the sequence ends
as any other does.

A JSON grammar leaves a value's length open (a string, a number's digits), so a model can
loop inside it until max_tokens, and cutting it there leaves invalid JSON. So a sequence
the loop detector finds looping under a JSON grammar is steered instead
(runtime/loops.py): its next token is one that closes the string (it begins with a quote)
or, where the grammar allows none, one that closes the object or array (a closing
bracket), or else one that ends the item (a comma). Where the grammar allows none of them
within CLOSE_WITHIN tokens, the sequence goes on as it was. Regex and choice grammars are
not steered: a quote or a comma means nothing to them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] [^ ]+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """The spec cannot be compiled (bad or unsupported); the message says what."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json" (any JSON value), "json_schema", "regex", "choice"
    source: str = ""  # the schema as JSON text, the regex, or the choices as a JSON list

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        # Key order kept: xgrammar makes the output's keys follow the schema's properties
        # (a "reasoning" before an "answer" must stay first).
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(choices, ensure_ascii=False))


# Tokens that close what a JSON value loops in, tried in this order: a string (a quote),
# then its object or array, then the item (a comma).
CLOSERS = ('"', "}]", ",")
JSON_KINDS = ("json", "json_schema")
CLOSE_WITHIN = 16  # tokens a steered sequence may wait for a closer the grammar allows


class Constraint:
    """One sequence's grammar: its xgrammar matcher; closers, the token sets that close a
    JSON value in the order they are tried (none: never steered); closing, the tokens left
    in which to close the value it loops in (set by the loop detector, 0 once closed);
    closed, how many times it was closed."""

    __slots__ = ("closed", "closers", "closing", "matcher")

    def __init__(self, matcher, closers: tuple[torch.Tensor, ...] = ()):
        self.matcher = matcher
        self.closers = closers
        self.closing = 0
        self.closed = 0

    @property
    def steerable(self) -> bool:
        return bool(self.closers)


class Grammars:
    """Compiles specs for one tokenizer (xgrammar's compiler is thread-safe: compile runs
    in worker threads)."""

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        stop_token_ids: set[int],
        max_threads: int = 2,
        cache_limit_bytes: int = 256 * 2**20,
    ):
        import xgrammar as xgr  # imported on first use: a server that never sees a grammar never loads it

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # Bounded: every distinct schema a client sends is compiled and cached.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=max_threads, cache_enabled=True, cache_limit_bytes=cache_limit_bytes
        )
        self.closers = tuple(_starting(info.decoded_vocab, firsts) for firsts in CLOSERS)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar for `spec` (from the cache when it was compiled before).
        Raises GrammarError naming what is wrong or unsupported."""
        c = self._compiler
        try:
            if spec.kind == "json":
                compiled = c.compile_builtin_json_grammar()
            elif spec.kind == "json_schema":
                # No free whitespace between tokens: a small model left free to add it can
                # emit newlines until max_tokens.
                compiled = c.compile_json_schema(spec.source, any_whitespace=False)
            elif spec.kind == "regex":
                compiled = c.compile_regex(spec.source)
            elif spec.kind == "choice":
                choices = json.loads(spec.source)
                compiled = c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(x, ensure_ascii=False) for x in choices)
                )
            else:
                raise GrammarError(f"unknown grammar kind {spec.kind!r}")
        except RuntimeError as exc:
            raise GrammarError(_clean(str(exc))) from None
        return compiled

    def constraint(self, compiled, spec: GrammarSpec) -> Constraint:
        return Constraint(self._xgr.GrammarMatcher(compiled), self.closers if spec.kind in JSON_KINDS else ())


def _starting(vocab: list[bytes], firsts: str) -> torch.Tensor:
    """(V,) bool: the tokens whose text begins with one of `firsts`, in the bitmask's layout
    (padded to whole 32-bit words)."""
    starts = tuple(c.encode() for c in firsts)
    marks = torch.zeros(32 * ((len(vocab) + 31) // 32), dtype=torch.bool)
    marks[: len(vocab)] = torch.tensor([text.startswith(starts) for text in vocab])
    return marks


def mask(logits: torch.Tensor, constraints: list[tuple[int, Constraint]]) -> None:
    """Mask, in place, the rows of `logits` given as (row, constraint): every token the row's
    grammar does not allow next becomes -inf, and of a closing row also every token that
    does not close its value, where the grammar allows one that does."""
    import xgrammar as xgr

    rows = [row for row, _ in constraints]
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    for k, (_, constraint) in enumerate(constraints):
        constraint.matcher.fill_next_token_bitmask(bitmask, k)
        if constraint.closing:
            _close(bitmask, k, constraint)
    if logits.is_cuda:  # xgrammar's own kernel
        part = logits[rows]
        xgr.apply_token_bitmask_inplace(part, bitmask.to(logits.device))
        logits[rows] = part
        return
    # xgrammar's CPU apply costs ~0.2 ms a row at this vocabulary; unpacking the bits with
    # numpy (bit j of 32-bit word w is token 32w + j; little-endian bytes) is 2.4x faster.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, : logits.shape[1]]
    forbidden = torch.from_numpy(bits) == 0
    if len(rows) == len(logits):
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def _close(bitmask: torch.Tensor, k: int, constraint: Constraint) -> None:
    """Narrow row k of the bitmask to the first set of closers the grammar allows any of."""
    allowed = _bits(bitmask[k])
    for closer in constraint.closers:
        narrowed = allowed & closer
        if narrowed.any():
            bitmask[k] = _words(narrowed)
            constraint.closing = 0  # the token sampled from this row closes the value
            constraint.closed += 1
            return
    constraint.closing -= 1


def _bits(words: torch.Tensor) -> torch.Tensor:
    """A bitmask row (int32 words; bit j of word w is token 32w + j) as bools."""
    return torch.from_numpy(np.unpackbits(words.numpy().astype("<i4").view(np.uint8), bitorder="little").astype(bool))


def _words(bits: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little").view("<i4").astype(np.int32))


def _clean(message: str) -> str:
    """xgrammar's C++ errors start with a time and a source location; keep the reason."""
    first = message.strip().splitlines()[0] if message.strip() else message
    return _CPP_PREFIX.sub("", first).strip()
