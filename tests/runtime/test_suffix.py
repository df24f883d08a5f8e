"""Suffix decoding's proposals without a model: the longest match, the most frequent
continuation, the bounds on a walk, and the per-tenant cache of recent outputs (kept
apart per tenant and adapter, bounded, the oldest leaving first)."""

from __future__ import annotations

import itertools

import numpy as np

from headroom.config import SpeculativeConfig
from headroom.contracts.request import AdapterRef, AdmissionRecord, Request, SamplingParams
from headroom.runtime.suffix import Corpus, SuffixCache

ANY = SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=0.0)
_ids = itertools.count()


def make_request(prompt: list[int], outputs: list[int] = (), tenant: str | None = None, lora=None) -> Request:
    request = Request(f"x{next(_ids)}", list(prompt), SamplingParams(max_tokens=100), lora=lora)
    request.admission = AdmissionRecord(tenant=tenant)
    for token in outputs:
        request.append_output(token)
    return request


def cache(**config) -> SuffixCache:
    return SuffixCache(SpeculativeConfig(**{"method": "suffix", **config}))


def test_the_longest_earlier_match_is_followed_for_as_many_tokens_as_it_is_long():
    # "1 2 3" occurs once before the end, then 4 5 6 7: a 3-token match guesses 3.
    request = make_request([1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3])
    assert cache().propose(request, 4).tokens == [4, 5, 6]
    assert cache(suffix_decoding_max_spec_factor=2.0).propose(request, 4).tokens == [4, 5, 6, 7]
    assert cache().propose(request, 2).tokens == [4, 5]
    # Nothing occurs before: nothing is guessed; the text's own end never counts as a match.
    assert cache().propose(make_request([5, 6, 7]), 4).tokens == []


def test_the_most_frequent_continuation_wins_and_a_tie_goes_to_the_latest():
    # After "0 7" (the token before it differs each time): 8 twice, then 9 once (the latest).
    request = make_request([5, 0, 7, 8, 1, 6, 0, 7, 8, 1, 4, 0, 7, 9, 1, 2, 0, 7])
    assert cache().propose(request, 1).tokens == [8]
    # One each: the latest occurrence's token.
    request = make_request([5, 0, 7, 8, 1, 6, 0, 7, 9, 1, 2, 0, 7])
    assert cache().propose(request, 1).tokens == [9]


def test_a_walk_stops_where_its_paths_frequency_falls_below_the_minimum():
    # After "5 6": 1 then 2 (once), 1 then 3 (once), 4 (once). Path 1 is 2/3; then 1/2 of
    # it is 1/3: above 0.3, below 0.4.
    prompt = [5, 6, 1, 2, 10, 5, 6, 1, 3, 11, 5, 6, 4, 12, 5, 6]
    assert cache(suffix_decoding_min_token_prob=0.3).propose(make_request(prompt), 2).tokens == [1, 3]
    assert cache(suffix_decoding_min_token_prob=0.4).propose(make_request(prompt), 2).tokens == [1]
    assert cache(suffix_decoding_min_token_prob=0.7).propose(make_request(prompt), 2).tokens == []


def test_a_match_is_no_longer_than_the_tree_depth():
    # The depth-2 pattern "2 3" occurs twice, followed once each by 4 and 8; at depth 3 the
    # pattern "1 2 3" picks its one continuation, 4.
    prompt = [1, 2, 3, 4, 0, 6, 2, 3, 8, 0, 1, 2, 3]
    assert cache(suffix_decoding_max_tree_depth=3).propose(make_request(prompt), 1).tokens == [4]
    assert cache(suffix_decoding_max_tree_depth=2).propose(make_request(prompt), 1).tokens == [8]


def test_a_tenants_finished_outputs_are_guessed_from_and_never_for_another_tenant():
    suffixes = cache()
    done = make_request([100], [20, 21, 22, 23, 24, 25], tenant="acme")
    suffixes.add(done)
    assert suffixes.propose(make_request([50, 20, 21, 22], tenant="acme"), 4).tokens == [23, 24, 25]
    assert suffixes.propose(make_request([50, 20, 21, 22], tenant="globex"), 4).tokens == []
    assert suffixes.propose(make_request([50, 20, 21, 22]), 4).tokens == []
    # Another adapter of the same tenant is another model: its outputs are its own.
    adapter = AdapterRef("sql", uid=3)
    assert suffixes.propose(make_request([50, 20, 21, 22], tenant="acme", lora=adapter), 4).tokens == []


def test_the_sequences_own_text_wins_where_it_is_the_better_evidence():
    suffixes = cache()
    suffixes.add(make_request([100], [7, 8, 9, 1, 2], tenant="acme"))
    # Its own text continues "7 8 9" with 5 5 5 (a 3-token match, probability 1 each), the
    # cache with 1 2 (a 3-token match too, scored the same per token but shorter).
    request = make_request([7, 8, 9, 5, 5, 5, 0, 7, 8, 9], tenant="acme")
    assert suffixes.propose(request, 3).tokens == [5, 5, 5]


def test_the_cache_keeps_the_newest_outputs_and_forgets_the_oldest_first():
    suffixes = cache(suffix_decoding_max_cached_requests=2)
    first = make_request([100], [30, 31, 32, 33], tenant="a")
    suffixes.add(first)
    suffixes.add(make_request([100], [40, 41, 42, 43], tenant="a"))
    suffixes.add(make_request([100], [50, 51, 52, 53], tenant="b"))
    assert list(suffixes.entries.values()) == [("a", None), ("b", None)]
    assert suffixes.propose(make_request([30, 31], tenant="a"), 2).tokens == []
    assert suffixes.propose(make_request([40, 41], tenant="a"), 2).tokens == [42, 43]
    assert suffixes.propose(make_request([50, 51], tenant="b"), 2).tokens == [52, 53]
    # None cached where the cache is off, nor an output with no tokens.
    off = cache(suffix_decoding_max_cached_requests=0)
    off.add(first)
    suffixes.add(make_request([100], [], tenant="c"))
    assert not off.entries and ("c", None) not in suffixes.corpora


def test_the_corpus_index_answers_as_a_scan_does_through_rebuilds_and_removals():
    rng = np.random.default_rng(7)
    corpus, outputs = Corpus(), {}
    for i in range(400):
        outputs[f"r{i}"] = rng.integers(0, 12, rng.integers(1, 40)).tolist()
        corpus.add(f"r{i}", outputs[f"r{i}"])
        if i % 3 == 0:  # every third leaves again, some indexed by now, some not
            gone = f"r{rng.integers(0, i + 1)}"
            if gone in outputs:
                corpus.remove(gone)
                del outputs[gone]
    assert len(corpus) == len(outputs) and len(corpus.spans) > 0
    for _ in range(200):
        pattern = rng.integers(0, 12, 3)
        # The reference: the most frequent token after the pattern over the live outputs,
        # with its count; the proposal's first token must have that count.
        follows = [
            out[i + 3] for out in outputs.values() for i in range(len(out) - 3) if out[i : i + 3] == pattern.tolist()
        ]
        walk = corpus.propose(pattern, ANY, 1)
        if not follows:
            continue  # a shorter match answers then; checked by the cases above
        counts = {t: follows.count(t) for t in follows}
        assert walk.tokens and counts.get(walk.tokens[0]) == max(counts.values())


def test_an_id_sent_again_replaces_its_earlier_output_wherever_that_was_cached():
    suffixes = cache(suffix_decoding_max_cached_requests=3)
    first = make_request([100], [30, 31, 32, 33], tenant="a")
    suffixes.add(first)
    again = make_request([100], [40, 41, 42, 43], tenant="b")
    again.request_id = first.request_id  # a client's X-Request-Id, used twice
    suffixes.add(again)
    assert dict(suffixes.entries) == {first.request_id: ("b", None)} and ("a", None) not in suffixes.corpora
    assert suffixes.propose(make_request([30, 31], tenant="a"), 2).tokens == []
    assert suffixes.propose(make_request([40, 41], tenant="b"), 2).tokens == [42, 43]
