"""Sampler behaviour on hand-made logits (no model involved)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from headroom.contracts.request import Request, SamplingParams
from headroom.executor.sampler import Sampler

EOS = 2
VOCAB = 16
_ids = itertools.count()


def make_request(request_id: str | None = None, outputs: list[int] = (), **sampling) -> Request:
    request = Request(request_id or f"s{next(_ids)}", [1, 5, 7], SamplingParams(**sampling))
    for token in outputs:
        request.append_output(token)
    return request


def draw(sampler: Sampler, logits: torch.Tensor, request: Request, n: int) -> list[int]:
    """n independent draws for one request: the same logits row repeated n times."""
    return sampler(logits.expand(n, -1).clone(), [request] * n).token_ids


def logits_from_probs(probs: list[float], order: list[int]) -> torch.Tensor:
    """A (1, len) row whose softmax puts probs[j] on token order[j]."""
    row = torch.full((len(probs),), 0.0)
    for p, token in zip(probs, order, strict=True):
        row[token] = math.log(p)
    return row.unsqueeze(0)


def test_greedy_is_argmax_for_temperature_zero_and_top_k_one():
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB) * 3
    sampler = Sampler({EOS})
    requests = [make_request(temperature=0.0) for _ in range(3)]
    # top_k=1 is greedy even at a high temperature.
    requests += [make_request(temperature=5.0, top_k=1) for _ in range(3)]
    assert all(r.sampling.greedy for r in requests)
    result = sampler(logits, requests)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 6
    # Greedy rows draw nothing: the shared generator is where a fresh one starts.
    fresh = torch.Generator().manual_seed(0)
    shared = sampler.shared_generator
    assert torch.equal(torch.rand(4, generator=shared), torch.rand(4, generator=fresh))


def test_non_greedy_rows_are_sampled_alongside_greedy_rows():
    # Token 3 is best but only slightly: a sampled row must sometimes pick another one.
    row = torch.tensor([[1.0, 1.0, 1.0, 1.2, 1.0, 1.0, 1.0, 1.0]])
    sampler = Sampler({EOS}, seed=7)
    greedy, sampled = make_request(temperature=0.0), make_request(temperature=1.0)
    logits = row.expand(400, -1).clone()
    tokens = sampler(logits, [greedy, sampled] * 200).token_ids
    assert set(tokens[0::2]) == {3}
    assert len(set(tokens[1::2])) == 8


def test_top_k_samples_only_the_k_best_tokens():
    # Nearly flat, so that without the cut every token would turn up in 2000 draws.
    row = torch.tensor([[1.0, 1.1, 1.5, 0.9, 1.2, 1.6, 1.0, 0.8]])
    sampler = Sampler({EOS}, seed=1)
    assert set(draw(sampler, row, make_request(top_k=2), 2000)) == {5, 2}
    assert set(draw(sampler, row, make_request(top_k=3), 2000)) == {5, 2, 4}
    assert set(draw(sampler, row, make_request(top_k=0), 2000)) == set(range(8))
    # top_k larger than the vocabulary keeps everything.
    assert set(draw(sampler, row, make_request(top_k=100), 2000)) == set(range(8))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.5, {3}),  # the best token alone reaches 0.5
        (0.7, {3, 0}),  # 0.5 + 0.3 = 0.8 >= 0.7
        (0.81, {3, 0, 2}),
        (1.0, {3, 0, 2, 1}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p, kept):
    row = logits_from_probs([0.5, 0.3, 0.15, 0.05], order=[3, 0, 2, 1])
    sampler = Sampler({EOS}, seed=2)
    assert set(draw(sampler, row, make_request(top_p=top_p), 2000)) == kept


def test_top_p_applies_after_temperature_and_top_k():
    row = logits_from_probs([0.5, 0.3, 0.15, 0.05], order=[3, 0, 2, 1])
    sampler = Sampler({EOS}, seed=3)
    # Temperature 3 flattens to about [0.34, 0.28, 0.22, 0.16]: 0.34 + 0.28 < 0.7.
    assert set(draw(sampler, row, make_request(top_p=0.7, temperature=3.0), 2000)) == {3, 0, 2}
    # top_k=3 first, then top-p over the renormalised three, about [0.53, 0.32, 0.16]:
    # the third token starts at 0.84. (Over the original four it would start at 0.80.)
    assert set(draw(sampler, row, make_request(top_k=3, top_p=0.9), 2000)) == {3, 0, 2}
    assert set(draw(sampler, row, make_request(top_k=3, top_p=0.82), 2000)) == {3, 0}


def seeded_sequence(sampler: Sampler, request: Request, rows: torch.Tensor, neighbours: list[Request]) -> list[int]:
    """Sample one token per logits row for `request`, with `neighbours` sharing the batch."""
    sampler.add(request)
    for other in neighbours:
        sampler.add(other)
    tokens = []
    for row in rows:
        batch = [*neighbours[:2], request, *neighbours[2:]]
        logits = row.expand(len(batch), -1).clone()
        tokens.append(sampler(logits, batch).token_ids[len(neighbours[:2])])
    return tokens


def test_seed_gives_the_same_tokens_across_samplers_and_batches():
    torch.manual_seed(0)
    rows = torch.randn(30, VOCAB) * 0.3  # flat enough that draws vary a lot
    alone = seeded_sequence(Sampler({EOS}, seed=0), make_request("a", seed=123), rows, [])
    neighbours = [
        make_request("n0"),
        make_request("n1", seed=999),
        make_request("n2", temperature=0.0),
        make_request("n3", temperature=0.5),
    ]
    crowded = seeded_sequence(Sampler({EOS}, seed=55), make_request("b", seed=123), rows, neighbours)
    assert alone == crowded
    other_seed = seeded_sequence(Sampler({EOS}, seed=0), make_request("c", seed=124), rows, [])
    assert other_seed != alone
    assert len(set(alone)) > 5  # really sampled, not argmax
    assert alone != rows.argmax(dim=-1).tolist()


def test_removed_seeded_request_restarts_its_sequence():
    rows = torch.zeros(10, VOCAB)
    sampler = Sampler({EOS})
    first = seeded_sequence(sampler, make_request("x", seed=5), rows, [])
    assert "x" in sampler.generators
    sampler.remove("x")
    assert "x" not in sampler.generators
    assert seeded_sequence(sampler, make_request("x", seed=5), rows, []) == first


def test_sampling_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0]])
    temperature = 0.7
    n = 4000
    sampler = Sampler({EOS}, seed=1234)
    tokens = draw(sampler, logits, make_request(temperature=temperature), n)
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    expected = (logits[0].double() / temperature).softmax(dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 5 degrees of freedom: P(chi2 > 25) < 1e-4. Sampling at temperature 1 instead
    # scores several hundred against these expectations.
    assert chi2 < 25, (counts.tolist(), expected.tolist())
    untempered = logits[0].double().softmax(dim=-1) * n
    assert float(((counts - untempered) ** 2 / untempered).sum()) > 100


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    sampler = Sampler({EOS})
    eos_best = torch.zeros(1, VOCAB)
    eos_best[0, EOS], eos_best[0, 9], eos_best[0, 4] = 10.0, 9.0, 8.0
    stop_best = torch.zeros(1, VOCAB)
    stop_best[0, 9], stop_best[0, EOS], stop_best[0, 4] = 10.0, 9.0, 8.0

    def pick(logits, **sampling) -> int:
        return sampler(logits.clone(), [make_request(**sampling)]).token_ids[0]

    greedy = {"temperature": 0.0, "max_tokens": 8}
    assert pick(eos_best, **greedy) == EOS
    assert pick(eos_best, min_tokens=2, **greedy) == 9  # next best, not EOS
    assert pick(eos_best, min_tokens=2, stop_token_ids=(9,), **greedy) == 4
    assert pick(stop_best, min_tokens=2, stop_token_ids=(9,), **greedy) == 4
    # ignore_eos: EOS is no stop, so it is not masked; stop_token_ids still are.
    assert pick(eos_best, min_tokens=2, ignore_eos=True, **greedy) == EOS
    assert pick(stop_best, min_tokens=2, ignore_eos=True, stop_token_ids=(9,), **greedy) == EOS
    # Masked while fewer than min_tokens outputs exist, free once they do.
    assert pick(eos_best, min_tokens=2, outputs=[5], **greedy) == 9
    assert pick(eos_best, min_tokens=2, outputs=[5, 6], **greedy) == EOS
    assert pick(stop_best, min_tokens=2, stop_token_ids=(9,), outputs=[5, 6], **greedy) == 9


def test_min_tokens_mask_applies_to_sampled_rows_and_only_its_own_row():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 3.0  # about 57% of the mass
    sampler = Sampler({EOS}, seed=4)
    masked = make_request(min_tokens=1)
    free = make_request()
    tokens = sampler(logits.expand(1000, -1).clone(), [masked, free] * 500).token_ids
    assert EOS not in tokens[0::2]
    assert len(set(tokens[0::2])) == VOCAB - 1
    # 500 unmasked draws at P(EOS) = e^3 / (e^3 + 15) = 0.57.
    assert 240 < tokens[1::2].count(EOS) < 330


def test_logprobs_are_from_the_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 2
    logits[2, EOS] = 20.0  # row 2 would pick EOS if it were not masked
    sampler = Sampler({EOS}, seed=9)
    requests = [
        make_request(temperature=0.5, logprobs=5),
        make_request(temperature=0.0),  # no logprobs asked for
        make_request(temperature=0.0, min_tokens=1, logprobs=3),
        make_request(temperature=2.0, top_k=4, logprobs=0),
    ]
    result = sampler(logits.clone(), requests)
    reference = logits.log_softmax(dim=-1)
    assert result.logprobs[1] is None
    for i, n in ((0, 5), (2, 3), (3, 0)):
        entry = result.logprobs[i]
        token = result.token_ids[i]
        assert entry.token_id == token
        # Raw: no temperature, no top-k, no min_tokens mask.
        assert entry.logprob == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert len(entry.top) == n
        values, ids = reference[i].topk(n)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-5)
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
    assert result.token_ids[2] != EOS
    assert result.logprobs[2].top[0] == (EOS, pytest.approx(reference[2, EOS].item(), abs=1e-5))


def test_no_logprobs_requested_gives_none_for_every_row():
    result = Sampler({EOS})(torch.randn(3, VOCAB), [make_request() for _ in range(3)])
    assert result.logprobs == [None, None, None]


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be in \[0, max_tokens\]"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, max_tokens\]"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
    ],
)
def test_sampling_params_validation(sampling, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**sampling)


def test_sampling_params_boundaries_are_accepted():
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, top_p=1.0, logprobs=20)
    assert params.greedy
    assert SamplingParams(logprobs=0).logprobs == 0
    assert not SamplingParams(temperature=0.1, top_k=2).greedy


# ---- penalties and logit_bias ---------------------------------------------------------------


def test_frequency_and_presence_penalties_follow_openais_formula():
    # Outputs so far: token 3 twice, token 4 once. The prompt ([1, 5, 7]) is not penalised.
    request = make_request(outputs=[3, 4, 3], frequency_penalty=0.5, presence_penalty=0.25, temperature=0)
    logits = torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0)
    out = Sampler({EOS}).adjust(logits, [request])
    expected = logits.clone()
    expected[0, 3] -= 2 * 0.5 + 0.25
    expected[0, 4] -= 1 * 0.5 + 0.25
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0))  # input untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    request = make_request(outputs=[9], repetition_penalty=2.0)
    logits = torch.linspace(-4, 4, VOCAB).unsqueeze(0)  # token 1 negative, 9 and 7 positive
    out = Sampler({EOS}).adjust(logits, [request])
    expected = logits.clone()
    for token in (1, 5, 7, 9):  # prompt [1, 5, 7] and output [9]
        value = logits[0, token].item()
        expected[0, token] = value / 2 if value > 0 else value * 2
    assert torch.equal(out, expected)


def test_logit_bias_adds_per_row_and_forces_greedy_choices():
    plain = make_request(temperature=0)
    biased = make_request(temperature=0, logit_bias=((11, 100.0), (0, -5.0)))
    logits = torch.zeros(2, VOCAB)
    logits[:, 6] = 1.0
    sampler = Sampler({EOS})
    out = sampler.adjust(logits, [plain, biased])
    assert torch.equal(out[0], logits[0])
    assert out[1, 11].item() == 100.0 and out[1, 0].item() == -5.0 and out[1, 6].item() == 1.0
    assert sampler(logits, [plain, biased]).token_ids == [6, 11]


def test_a_batch_without_penalties_or_bias_is_not_copied():
    logits = torch.randn(3, VOCAB)
    assert Sampler({EOS}).adjust(logits, [make_request() for _ in range(3)]) is logits


def test_penalties_and_bias_are_validated():
    for fields in (
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 101.0),)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**fields)
