"""What the admission sidecar knows about a request before it runs, and the fixed-width
vector the length predictor sees. Everything here is computable at admission time: the
prompt, its token count, the sampling settings and the tenant; never the output.

Hashed features use zlib.crc32, not hash(), so a model trained in one process reads the
same buckets in another (PYTHONHASHSEED randomises str hashes per process).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from importlib import resources

import numpy as np

# Bump when featurize() changes meaning or width; a saved model records the version it
# was trained with and is refused under another.
FEATURE_VERSION = 1

HASH_BUCKETS = 512
TENANT_BUCKETS = 1024
# Instructions sit at the start or the end of a prompt; the middle of a long paste adds
# cost, not signal.
_HEAD_CHARS = 2000
_TAIL_CHARS = 1000


@dataclass(frozen=True)
class RequestFeatures:
    prompt_tokens: int
    turns: int  # user turns
    system_chars: int
    prompt_chars: int  # all message text, system and earlier assistant turns included
    max_tokens: int
    temperature: float
    tenant: str
    text: str  # the user turns, joined by newlines

    @classmethod
    def from_messages(
        cls, messages: list[dict], prompt_tokens: int, max_tokens: int, temperature: float, tenant: str = ""
    ) -> RequestFeatures:
        user = [_content(m) for m in messages if m.get("role") == "user"]
        system_chars = sum(len(_content(m)) for m in messages if m.get("role") == "system")
        return cls(
            prompt_tokens=int(prompt_tokens),
            turns=len(user),
            system_chars=system_chars,
            prompt_chars=sum(len(_content(m)) for m in messages),
            max_tokens=int(max_tokens),
            temperature=float(temperature),
            tenant=tenant,
            text="\n".join(user),
        )

    @classmethod
    def from_record(cls, row: dict, prompt_tokens: int | None = None) -> RequestFeatures:
        """A calibration row (prompt or messages, max_tokens, temperature, tenant?)."""
        messages = row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
        return cls.from_messages(
            messages,
            prompt_tokens=row["prompt_tokens"] if prompt_tokens is None else prompt_tokens,
            max_tokens=row["max_tokens"],
            temperature=row.get("temperature", 1.0),
            tenant=str(row.get("tenant", "")),
        )


def _content(message: dict) -> str:
    content = message.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts; only text parts carry length hints
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


# Hints are found on the word lists, not with regexes over the text: one \w+ pass plus set
# and dict lookups keeps featurize near 50 us for a 1k-character prompt, where a dozen
# alternation regexes cost several hundred. The lists are data (data/words.json).
_LISTS = json.loads(resources.files("headroom.prediction").joinpath("data/words.json").read_text(encoding="utf-8"))
_NUM_WORDS: dict[str, int] = _LISTS["numbers"]
# unit word -> (code, rough output tokens per unit)
_UNITS: dict[str, tuple[int, int]] = {w: tuple(v) for w, v in _LISTS["units"].items()}
_UNIT_WORDS = {w + s: v for w, v in _UNITS.items() for s in ("", "s")}
# "a"/"an" count as one only before units where "in a sentence" is a real length request.
_A_UNITS = frozenset(_LISTS["a_units"])
# Words that may sit between the number and the unit: "3 short paragraphs", "5 bullet points".
_FILLERS = frozenset(_LISTS["fillers"])
_LIST_VERBS = frozenset(_LISTS["list_verbs"])
_LIST_NOUNS = frozenset(_LISTS["list_nouns"])
_SKIP_AFTER_VERB = frozenset(_LISTS["skip_after_verb"])
_BRIEF_WORDS = frozenset(_LISTS["brief_words"])
_BRIEF_PHRASES = tuple(_LISTS["brief_phrases"])
_DETAILED_WORDS = frozenset(_LISTS["detailed_words"])
_DETAILED_PHRASES = tuple(_LISTS["detailed_phrases"])
_YES_NO_PHRASES = tuple(_LISTS["yes_no_phrases"])
_CODE_WORDS = frozenset(_LISTS["code_words"])
_WRITE_WORDS = frozenset(_LISTS["write_words"])
_REWRITE_WORDS = frozenset(_LISTS["rewrite_words"])
_ROLEPLAY_PHRASES = tuple(_LISTS["roleplay_phrases"])
_WH_WORDS = frozenset(_LISTS["wh_words"])
_PHRASE_WORDS = {
    p: frozenset(re.findall(r"\w+", p))
    for p in _BRIEF_PHRASES + _DETAILED_PHRASES + _YES_NO_PHRASES + _ROLEPLAY_PHRASES
}
_TRIGGERS = frozenset(_UNIT_WORDS) | _LIST_VERBS | _LIST_NOUNS
_WORD = re.compile(r"\w+")
# On ASCII text, mapping every non-word character to a space and splitting gives the same
# tokens as \w+, about four times faster.
_NON_WORD = str.maketrans({chr(c): " " for c in range(128) if not (chr(c).isalnum() or chr(c) == "_")})
_CHOICE = re.compile(r"(?m)^\s*(?:[a-dA-D][).]|\([a-dA-D]\))\s")
_UPPER = bytes(range(ord("A"), ord("Z") + 1))
_DIGITS = b"0123456789"

_NUMERIC = (
    "prompt_tokens",
    "log_max_tokens",
    "temperature",
    "greedy",
    "turns",
    "system_chars",
    "prompt_chars",
    "words",
    "chars_per_token",
    "question_marks",
    "newlines",
    "non_ascii_frac",
    "digit_frac",
    "upper_frac",
    "code_fence",
    "ends_with_question",
    "wh_start",
    "hint_number",
    "hint_unit",
    "hint_tokens",
    "hint_tokens_over_max",
    "brief",
    "detailed",
    "list_n",
    "yes_no",
    "code_words",
    "write",
    "rewrite",
    "roleplay",
    "choices",
    "tenant_bucket",
)
FEATURE_NAMES: tuple[str, ...] = _NUMERIC + tuple(f"h{i}" for i in range(HASH_BUCKETS))
NUM_FEATURES = len(FEATURE_NAMES)

# Word -> crc32; prompts reuse a few thousand words, so this stays small and turns the
# per-word crc32 into one dict lookup. Bounded so odd inputs cannot grow it forever.
_HASH_CACHE: dict[str, int] = {}
_HASH_CACHE_MAX = 200_000


def _word_hash(word: str) -> int:
    h = _HASH_CACHE.get(word)
    if h is None:
        h = zlib.crc32(word.encode("utf-8"))
        if len(_HASH_CACHE) < _HASH_CACHE_MAX:
            _HASH_CACHE[word] = h
    return h


def stable_bucket(value: str, buckets: int) -> int:
    return zlib.crc32(value.encode("utf-8")) % buckets


def _number(word: str, unit: str | None = None) -> float:
    if word.isdigit() and len(word) <= 5:
        return float(word)
    if unit is not None and word in ("a", "an") and unit.rstrip("s") in _A_UNITS:
        return 1.0
    return float(_NUM_WORDS.get(word, 0))


def _hints(words: list[str]) -> tuple[float, float, float, float]:
    """(number, unit code, rough output tokens) of the first "N words/sentences/..." hint,
    and N of the first "list N" / "N ideas" request."""
    hint_n = hint_unit = hint_tokens = list_n = 0.0
    for i, w in enumerate(words):
        if w not in _TRIGGERS:
            continue
        if not hint_n and w in _UNIT_WORDS and i:
            j = i - 2 if words[i - 1] in _FILLERS and i >= 2 else i - 1
            n = _number(words[j], w)
            if n:
                code, per_unit = _UNIT_WORDS[w]
                hint_n, hint_unit, hint_tokens = n, float(code), n * per_unit
        if not list_n and w in _LIST_VERBS:
            j = i + 1
            while j < len(words) and j <= i + 3 and words[j] in _SKIP_AFTER_VERB:
                j += 1
            if j < len(words):
                list_n = _number(words[j])
        if not list_n and w in _LIST_NOUNS and i:
            j = i - 2 if i >= 2 and not _number(words[i - 1]) else i - 1
            list_n = _number(words[j])
    return hint_n, hint_unit, hint_tokens, list_n


def _words(low: str) -> list[str]:
    return low.translate(_NON_WORD).split() if low.isascii() else _WORD.findall(low)


def _phrases(text: str, words: set[str], phrases: tuple[str, ...]) -> int:
    # A substring search costs ~1 us per phrase on a long prompt; most phrases are ruled
    # out by a missing word first.
    return sum(_PHRASE_WORDS[p] <= words and p in text for p in phrases)


def featurize(f: RequestFeatures) -> np.ndarray:
    text = f.text
    if len(text) > _HEAD_CHARS + _TAIL_CHARS:
        text = text[:_HEAD_CHARS] + "\n" + text[-_TAIL_CHARS:]
    low = text.lower()
    raw = text.encode("utf-8")
    n_chars = max(len(text), 1)
    words = _words(low)
    uniq = set(words)
    hint_n, hint_unit, hint_tokens, list_n = _hints(words) if not uniq.isdisjoint(_TRIGGERS) else (0.0,) * 4

    out = np.zeros(NUM_FEATURES, dtype=np.float32)
    out[: len(_NUMERIC)] = (
        f.prompt_tokens,
        math.log(max(f.max_tokens, 1)),
        f.temperature,
        f.temperature <= 0.0,
        f.turns,
        f.system_chars,
        f.prompt_chars,
        len(words),
        f.prompt_chars / max(f.prompt_tokens, 1),
        low.count("?"),
        low.count("\n"),
        (len(raw) - len(text)) / n_chars,  # extra UTF-8 bytes: how much is not English
        (len(raw) - len(raw.translate(None, _DIGITS))) / n_chars,
        (len(raw) - len(raw.translate(None, _UPPER))) / n_chars,
        "```" in low,
        low.rstrip().endswith("?"),
        bool(words) and words[0] in _WH_WORDS,
        hint_n,
        hint_unit,
        hint_tokens,
        hint_tokens / max(f.max_tokens, 1),
        len(uniq & _BRIEF_WORDS) + _phrases(low, uniq, _BRIEF_PHRASES),
        len(uniq & _DETAILED_WORDS) + _phrases(low, uniq, _DETAILED_PHRASES),
        list_n,
        _phrases(low, uniq, _YES_NO_PHRASES),
        len(uniq & _CODE_WORDS),
        len(uniq & _WRITE_WORDS),
        len(uniq & _REWRITE_WORDS),
        _phrases(low, uniq, _ROLEPLAY_PHRASES),
        len(_CHOICE.findall(text)),
        stable_bucket(f.tenant, TENANT_BUCKETS),
    )
    if words:
        get = _HASH_CACHE.get
        hashes = np.array([get(w) or _word_hash(w) for w in words], dtype=np.uint64)
        # Bigrams combine the two word hashes arithmetically (uint64 wraps): stable, and no
        # string building.
        bigrams = hashes[:-1] * np.uint64(1_000_003) + hashes[1:]
        idx = np.concatenate((hashes, bigrams)) % np.uint64(HASH_BUCKETS)
        out[len(_NUMERIC) :] = np.bincount(idx.astype(np.intp), minlength=HASH_BUCKETS)
    return out
