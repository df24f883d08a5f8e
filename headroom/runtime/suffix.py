"""Suffix decoding's proposals (Arctic Inference's method, as vLLM's "suffix"): the
continuation of the sequence's last tokens that its own text, and the outputs of the same
tenant's recent requests, make most frequent.

The suffix tree is walked without being stored: a node is the set of places where the
pattern it spells ends, so its children's counts are the tokens that follow those places.
The walk starts at the longest suffix of the sequence (up to max_tree_depth tokens) that
occurs with something after it, and follows the most frequent next token while the
product of the choices' frequencies stays at least min_token_prob; a match of n tokens
may propose at most n * max_spec_factor (a longer match is better evidence). Of the
sequence's own text and its tenant's cache, the walk with the greater expected number of
kept tokens (the sum of those products) is proposed.

The cache is per tenant and adapter: a guess's acceptance shows in how fast tokens come,
so a tenant is never guessed for from another tenant's text.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from headroom.config import SpeculativeConfig
from headroom.contracts.request import Request

GAP = -1  # between cached outputs: never a token, so no pattern matches across two


@dataclass
class Walk:
    """A proposal, and each of its tokens' chance of being kept by the path's frequencies."""

    tokens: list[int] = field(default_factory=list)
    chances: list[float] = field(default_factory=list)

    @property
    def score(self) -> float:
        """The expected number of its tokens kept."""
        return sum(self.chances)


def match(text: np.ndarray, pattern: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, int]:
    """Of `ends` (places in text where pattern's last token is), those where the longest
    suffix of pattern that occurs at any of them ends, and its length."""
    length = 1 if len(ends) else 0
    for back in range(1, len(pattern)):
        keep = ends[ends >= back]
        keep = keep[text[keep - back] == pattern[-1 - back]]
        if not len(keep):
            break
        ends, length = keep, back + 1
    return ends, length


def walk(text: np.ndarray, ends: np.ndarray, most: int, min_prob: float) -> Walk:
    """Follow the most frequent next token from the places `ends`, at most `most` tokens,
    while the path's probability stays at least min_prob. Ties go to the token that
    followed the latest place."""
    out = Walk()
    prob = 1.0
    while len(out.tokens) < most:
        ends = ends[ends + 1 < len(text)]
        follow = text[ends + 1]
        ends, follow = ends[follow != GAP], follow[follow != GAP]
        if not len(ends):
            break
        tokens, latest, counts = np.unique(follow[::-1], return_index=True, return_counts=True)
        best = np.lexsort((latest, -counts))[0]
        prob *= counts[best] / len(follow)
        if prob < min_prob:
            break
        out.tokens.append(int(tokens[best]))
        out.chances.append(float(prob))
        ends = ends[follow == tokens[best]] + 1
    return out


def propose(text: np.ndarray, pattern: np.ndarray, ends: np.ndarray, config: SpeculativeConfig, k: int) -> Walk:
    ends, length = match(text, pattern, ends)
    most = min(k, int(length * config.suffix_decoding_max_spec_factor))
    return walk(text, ends, most, config.suffix_decoding_min_token_prob)


class Corpus:
    """One tenant's cached outputs end to end, searchable by token: an index sorted by token
    over most of them, and the newest few not yet indexed, scanned as they are. The index
    is built again when the unindexed part passes a quarter of it, so each cached token is
    sorted a bounded number of times."""

    def __init__(self) -> None:
        self.text = np.empty(0, dtype=np.int64)  # indexed outputs, each followed by GAP
        self.order = np.empty(0, dtype=np.int64)  # positions in text, by token, then position
        self.sorted = np.empty(0, dtype=np.int64)  # text[order]
        self.spans: dict[str, tuple[int, int]] = {}  # request id -> its slice of text
        self.fresh: dict[str, np.ndarray] = {}  # outputs not indexed yet, oldest first
        self.fresh_tokens = 0
        self.whole: np.ndarray | None = None  # text, then the fresh outputs: built when asked for

    def add(self, request_id: str, tokens: list[int]) -> None:
        self.fresh[request_id] = np.asarray([*tokens, GAP], dtype=np.int64)
        self.fresh_tokens += len(tokens) + 1
        self.whole = None
        if self.fresh_tokens > max(len(self.text) // 4, 1024):
            self._index()

    def remove(self, request_id: str) -> None:
        self.whole = None
        fresh = self.fresh.pop(request_id, None)
        if fresh is not None:
            self.fresh_tokens -= len(fresh)
            return
        start, stop = self.spans.pop(request_id)
        self.text[start:stop] = GAP  # its places stay in the index and no longer match

    def __len__(self) -> int:
        return len(self.spans) + len(self.fresh)

    def _index(self) -> None:
        parts = {rid: self.text[start:stop] for rid, (start, stop) in self.spans.items()} | self.fresh
        self.spans, at = {}, 0
        for rid, part in parts.items():
            self.spans[rid] = (at, at + len(part))
            at += len(part)
        self.text = np.concatenate(list(parts.values())) if parts else np.empty(0, dtype=np.int64)
        self.order = np.argsort(self.text, kind="stable")
        self.sorted = self.text[self.order]
        self.fresh, self.fresh_tokens, self.whole = {}, 0, None

    def propose(self, pattern: np.ndarray, config: SpeculativeConfig, k: int) -> Walk:
        if self.whole is None:
            self.whole = np.concatenate([self.text, *self.fresh.values()])
        token = pattern[-1]
        lo, hi = np.searchsorted(self.sorted, [token, token + 1])
        # A removed output's places are still indexed; its tokens are GAP now, which no
        # pattern matches and no walk follows.
        size = len(self.text)
        fresh = np.flatnonzero(self.whole[size:] == token) + size
        ends = np.concatenate([self.order[lo:hi], fresh])  # by position
        return propose(self.whole, pattern, ends, config, k)


class SuffixCache:
    """The outputs of recent requests, per tenant and adapter, at most
    suffix_decoding_max_cached_requests of them in all (the oldest leave first)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.corpora: dict[tuple, Corpus] = {}
        self.entries: OrderedDict[str, tuple] = OrderedDict()  # request id -> its corpus key, oldest first

    @staticmethod
    def key(request: Request) -> tuple:
        return (request.tenant, request.lora.uid if request.lora is not None else None)

    def add(self, request: Request) -> None:
        limit = self.config.suffix_decoding_max_cached_requests
        if limit <= 0 or not request.output_token_ids:
            return
        if request.request_id in self.entries:  # an id a client sent again: the newer output
            self._remove(request.request_id)
        key = self.key(request)
        self.corpora.setdefault(key, Corpus()).add(request.request_id, request.output_token_ids)
        self.entries[request.request_id] = key
        while len(self.entries) > limit:
            self._remove(next(iter(self.entries)))

    def _remove(self, request_id: str) -> None:
        key = self.entries.pop(request_id)
        corpus = self.corpora[key]
        corpus.remove(request_id)
        if not len(corpus):
            del self.corpora[key]

    def propose(self, request: Request, k: int) -> Walk:
        """At most k guesses for the request: from its own text or its tenant's cache."""
        config = self.config
        text = np.asarray(request.all_token_ids, dtype=np.int64)
        pattern = text[-config.suffix_decoding_max_tree_depth :]
        best = propose(text, pattern, np.flatnonzero(text[:-1] == pattern[-1]), config, k)
        corpus = self.corpora.get(self.key(request))
        if corpus is not None:
            cached = corpus.propose(pattern, config, k)
            if cached.score > best.score:
                best = cached
        return best
