"""IncrementalDetokenizer with the default model's real (byte-level BPE) tokenizer."""

from __future__ import annotations

import pytest

from headroom.runtime.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
UNICODE_TEXTS = [
    "Café crème — Ångström, œuvre, Dvořák in Łódź",
    "東京タワーは高いです。日本語の文章",
    "Party time 😀🎉 flags 🇯🇵🇫🇷 and 👩‍👩‍👧 family",
    "mixed: Ünïcödé 東京 😀 done",
]


@pytest.fixture(scope="module")
def hf(default_model):
    return default_model.tokenizer.hf  # tests/conftest.py: loaded once per session


@pytest.fixture(scope="module")
def prompt(hf) -> list[int]:
    return hf.encode("Please repeat after me:", add_special_tokens=False)


def encode(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[str], str | None]:
    """Feed ids `chunk` at a time as the engine would, stopping at a stop string hit.
    Returns every delta (the last one from finish()) and the hit."""
    deltas: list[str] = []
    for start in range(0, len(ids), chunk):
        delta, hit = detok.add_tokens(ids[start : start + chunk])
        deltas.append(delta)
        if hit is not None:
            return deltas, hit
    deltas.append(detok.finish())
    return deltas, None


@pytest.mark.parametrize("text", UNICODE_TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_text_equals_full_decode_without_replacement_chars(hf, prompt, text, chunk):
    ids = encode(hf, text)
    # The test is only worth something if characters really are split across tokens.
    assert any(REPLACEMENT in hf.decode([t]) for t in ids)
    deltas, hit = stream(IncrementalDetokenizer(hf, prompt), ids, chunk)
    assert hit is None
    assert not any(REPLACEMENT in d for d in deltas)
    assert "".join(deltas) == hf.decode(ids, skip_special_tokens=True) == text


def test_deltas_are_released_as_soon_as_a_character_is_complete(hf, prompt):
    ids = encode(hf, "a😀b")
    pieces = [hf.decode([t]) for t in ids]
    # The emoji's four bytes come in more than one token.
    assert len(ids) >= 4 and pieces[0] == "a" and pieces[-1] == "b"
    detok = IncrementalDetokenizer(hf, prompt)
    deltas = [detok.add_tokens([t])[0] for t in ids]
    assert deltas[0] == "a"
    assert deltas[1:-2] == [""] * (len(ids) - 3)  # emoji incomplete: nothing yet
    assert deltas[-2:] == ["😀", "b"]
    assert detok.finish() == ""


def test_special_tokens_are_not_in_the_text(hf, prompt):
    ids = encode(hf, "Hello there") + [hf.eos_token_id]
    deltas, _ = stream(IncrementalDetokenizer(hf, prompt), ids)
    assert "".join(deltas) == "Hello there"


def token_end_offsets(hf, ids: list[int]) -> list[int]:
    """Character length of the decoded text after each token (ASCII text)."""
    return [len(hf.decode(ids[: i + 1])) for i in range(len(ids))]


def test_stop_string_spanning_several_tokens(hf, prompt):
    text = "The answer is forty-two, and that is the end of the story."
    stop = "the end of"
    ids = encode(hf, text)
    ends = token_end_offsets(hf, ids)
    start = text.index(stop)
    first = next(i for i, e in enumerate(ends) if e > start)
    last = next(i for i, e in enumerate(ends) if e >= start + len(stop))
    assert last - first >= 2  # the stop string spans at least three tokens

    detok = IncrementalDetokenizer(hf, prompt, stop=(stop,))
    released = ""
    for i, token in enumerate(ids):
        delta, hit = detok.add_tokens([token])
        released += delta
        if i < last:
            assert hit is None
            # Everything but a possible stop-string prefix (len(stop) - 1 chars) is out.
            assert released == text[: max(ends[i] - (len(stop) - 1), 0)]
        else:
            break
    assert hit == stop
    assert released == text[:start] == "The answer is forty-two, and that is "
    assert detok.finish() == ""


def test_text_is_never_released_past_a_partial_stop_string(hf, prompt):
    # "The end" appears twice before the full stop string "The end." does.
    text = "The end is near. The end is here. The end. Not this part."
    stop = "The end."
    ids = encode(hf, text)
    final = text[: text.index(stop)]
    detok = IncrementalDetokenizer(hf, prompt, stop=(stop,))
    released = ""
    for token in ids:
        delta, hit = detok.add_tokens([token])
        released += delta
        assert final.startswith(released)
        if hit is not None:
            break
    assert hit == stop
    assert released == final == "The end is near. The end is here. "
    assert detok.text == final


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_of_several_stop_strings_wins(hf, prompt, chunk):
    text = "Call me at noon, or at dusk, whichever comes first."
    ids = encode(hf, text)
    # Both complete on the same token; the one that starts earlier wins.
    detok = IncrementalDetokenizer(hf, prompt, stop=("dusk", "or at dusk"))
    deltas, hit = stream(detok, ids, chunk)
    assert (hit, "".join(deltas)) == ("or at dusk", "Call me at noon, ")
    # With the whole text in one step, the earliest in the text wins over the list order.
    detok = IncrementalDetokenizer(hf, prompt, stop=("first", "noon", "dusk"))
    deltas, hit = stream(detok, ids, chunk)
    assert (hit, "".join(deltas)) == ("noon", "Call me at ")


def test_stop_string_with_split_multibyte_characters(hf, prompt):
    text = "Visit 東京タワー tonight 😀 then stop 🇯🇵 here"
    ids = encode(hf, text)
    cases = [
        ("タワー", "Visit 東京"),
        ("😀 then", "Visit 東京タワー tonight "),
        ("🇯🇵", "Visit 東京タワー tonight 😀 then stop "),
    ]
    for stop, before in cases:
        deltas, hit = stream(IncrementalDetokenizer(hf, prompt, stop=(stop,)), ids)
        assert hit == stop
        assert not any(REPLACEMENT in d for d in deltas)
        assert "".join(deltas) == before


def test_no_stop_hit_releases_everything_at_finish(hf, prompt):
    text = "A sentence that almost says the end but not quite the en"
    ids = encode(hf, text)
    detok = IncrementalDetokenizer(hf, prompt, stop=("the end.", ""))
    released = "".join(detok.add_tokens([t])[0] for t in ids)
    # The last len("the end.") - 1 characters are held back until finish().
    assert released == text[: len(text) - 7]
    assert detok.finish() == text[-7:]
    assert detok.finish() == ""
