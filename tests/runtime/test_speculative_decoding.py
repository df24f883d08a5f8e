"""Speculative decoding on the default model: the same tokens with guesses as without,
greedy on 30 prompts in float32 and in the quantised default, for each proposer (the loop detector among what
decides them), and the stop strings, logprobs and max_tokens of a request behaving as they
do without guesses."""

from __future__ import annotations

import re

import pytest

from headroom.config import CacheConfig, Config, ModelConfig, SpeculativeConfig
from headroom.contracts.request import Request, SamplingParams
from headroom.executor.device import prepare_model
from headroom.executor.executor import Executor
from headroom.executor.grammar import GrammarSpec
from headroom.models.loader import LoadedModel, default_model_path
from headroom.models.quant import BATCH_SIZES, QuantLinear
from headroom.observability.request_metrics import RequestMetrics
from headroom.runtime.drafter import Drafter
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput
from headroom.runtime.speculation import Speculator

pytestmark = pytest.mark.slow

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
# Suffix decoding, guessing also from the outputs of the prompts decoded before (one tenant).
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4)
PROPOSERS = {"ngram": NGRAM, "suffix": SUFFIX}
GROUP = 6  # prompts decoded at once

CODE = (
    "def area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)
TEXT = (
    "The committee met on Tuesday to review the budget. It agreed to fund the library repairs, "
    "postpone the new playground, and ask the council for a second bus route."
)
TASKS = [
    "Repeat the following exactly, then stop:\n{}",
    "Rewrite the following, fixing any mistakes:\n{}",
    "Quote the first sentence of this text:\n{}",
    "Copy this text and add a title:\n{}",
    "Summarise this in one sentence:\n{}",
]
QUESTIONS = [
    "What is the capital of France?",
    "List the days of the week.",
    "Count from one to twenty in words.",
    "Write a haiku about autumn rain.",
    "Explain what a prime number is.",
    "Name three primary colours.",
    "Spell the word 'necessary' letter by letter.",
    "Give me a recipe for pancakes.",
    "Write the alphabet in capital letters, separated by commas.",
    "What is two plus two?",
]


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    tok = default_model.tokenizer
    grounded = [task.format(body) for task in TASKS for body in (CODE, TEXT, CODE.upper(), TEXT.lower())]
    chats = [tok.apply_chat_template([{"role": "user", "content": text}]) for text in grounded + QUESTIONS]
    assert len(chats) == 30
    return chats


@pytest.fixture(scope="module")
def models(default_model) -> dict[str, LoadedModel]:
    """The default model in float32, and quantised as a server quantises it by default (the
    engine takes a loaded model as it is)."""
    quantized, _ = prepare_model(ModelConfig())
    assert quantized.quantization != "none"
    # A linear takes the packed kernel up to small_batch rows and the tiled one above; the
    # crossover is timed at start, so beside a busy core it can fall between a plain step's 6
    # rows and a guessing step's 30, and the two runs would differ by arithmetic, not by
    # guesses. Pinned above both, so these tests compare guesses alone.
    for module in quantized.model.modules():
        if isinstance(module, QuantLinear):
            module.small_batch = max(BATCH_SIZES)
    return {"none": default_model, "auto": quantized}


def engine(loaded, quantization: str, speculative: SpeculativeConfig | None) -> Engine:
    """With speculation, every row that can guess does: what these tests check is that
    guesses never change the output, wherever the price would put them (the price has
    its own tests, tests/runtime/test_speculation.py, and moves with the machine's load)."""
    speculative = speculative or SpeculativeConfig(method="off")
    config = Config(model=ModelConfig(quantization=quantization), speculative=speculative)
    e = Engine(config, loaded=loaded)
    if e.scheduler.speculator is not None:
        e.scheduler.speculator.priced = False
    return e


def run(e: Engine, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    """Each prompt's outputs merged into one: its tokens, text, logprobs and finish."""
    merged: dict[str, RequestOutput] = {}

    def sink(output: RequestOutput) -> None:
        seen = merged.setdefault(output.request_id, RequestOutput(output.request_id, [], "", logprobs=[]))
        seen.new_token_ids += output.new_token_ids
        seen.text += output.text
        seen.logprobs += output.logprobs or []
        seen.finished, seen.finish_reason, seen.stop_reason = output.finished, output.finish_reason, output.stop_reason

    order = []
    for start in range(0, len(prompts), GROUP):
        group = sampling[start : start + GROUP] if isinstance(sampling, list) else sampling
        order += [r.request_id for r in e.generate(prompts[start : start + GROUP], group, sink)]
    return [merged[rid] for rid in order]


_plain: dict[str, tuple[list[RequestOutput], int]] = {}
GREEDY = SamplingParams(max_tokens=40, temperature=0)


def decoded(models, prompts, quantization: str) -> tuple[list[RequestOutput], int]:
    """The 30 prompts decoded greedily without guesses, and the steps it took (once each)."""
    if quantization not in _plain:
        decoding = engine(models[quantization], quantization, None)
        _plain[quantization] = run(decoding, prompts, GREEDY), decoding.stats.steps
    return _plain[quantization]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_greedy_tokens_are_the_same_with_guesses_as_without(models, prompts, quantization, method):
    plain, steps = decoded(models, prompts, quantization)
    guessing = engine(models[quantization], quantization, PROPOSERS[method])
    guessed = run(guessing, prompts, GREEDY)
    for i, (a, b) in enumerate(zip(plain, guessed, strict=True)):
        assert b.new_token_ids == a.new_token_ids, f"prompt {i}"
        assert (b.text, b.finish_reason) == (a.text, a.finish_reason), f"prompt {i}"
    stats = guessing.stats
    # The grounded prompts copy their text: most guesses are kept, and steps are saved.
    assert stats.spec_draft_tokens >= 200
    assert stats.spec_accepted_tokens >= stats.spec_draft_tokens / 2
    assert stats.steps < steps


def test_stop_strings_logprobs_and_max_tokens_behave_as_without_guesses(default_model, prompts):
    grounded = prompts[:4]
    base = SamplingParams(max_tokens=48, temperature=0)
    texts = [o.text for o in run(engine(default_model, "none", None), grounded, base)]
    # A stop string from the middle of each output, so that it lands amid kept guesses.
    stops = tuple(sorted({t[len(t) // 2 : len(t) // 2 + 6] for t in texts if len(t) > 20}))
    assert stops
    cases = [
        SamplingParams(max_tokens=48, temperature=0, stop=stops),
        SamplingParams(max_tokens=48, temperature=0, logprobs=2),
        SamplingParams(max_tokens=7, temperature=0),
    ]
    for sampling in cases:
        plain = run(engine(default_model, "none", None), grounded, sampling)
        guessing = engine(default_model, "none", NGRAM)
        guessed = run(guessing, grounded, sampling)
        assert guessing.stats.spec_accepted_tokens > 0
        if sampling.stop:
            assert any(a.finish_reason == "stop" and a.stop_reason in stops for a in plain)
        for a, b in zip(plain, guessed, strict=True):
            assert (b.new_token_ids, b.text, b.finish_reason, b.stop_reason) == (
                a.new_token_ids,
                a.text,
                a.finish_reason,
                a.stop_reason,
            )
            # The same tokens and alternatives; their values agree to float32's last few bits:
            # the output projection's matmul (MKL's sgemm) rounds a row apart by how many rows
            # it computes at once, as it does without guesses for any batch.
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in b.logprobs] == [
                (lp.token_id, [t for t, _ in lp.top]) for lp in a.logprobs
            ]
            values = [[lp.logprob, *(v for _, v in lp.top)] for lp in a.logprobs]
            assert [[lp.logprob, *(v for _, v in lp.top)] for lp in b.logprobs] == [
                pytest.approx(v, abs=1e-4) for v in values
            ]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_blocks_are_all_free_after_guessing(models, prompts, method):
    e = engine(models["auto"], "auto", PROPOSERS[method])
    requests = e.generate(prompts[:6], SamplingParams(max_tokens=40, temperature=0.7, seed=3))
    assert e.stats.spec_draft_tokens > 0
    # Each request's own figures (its span's and its `metrics` object's) add up to the
    # engine's counters.
    figures = [RequestMetrics.of(r, r.arrival_time, r.finished_time) for r in requests]
    assert sum(f.spec_draft_tokens for f in figures) == e.stats.spec_draft_tokens
    assert sum(f.spec_accepted_tokens for f in figures) == e.stats.spec_accepted_tokens
    assert e.block_manager.num_used_blocks == 0 and not e.block_manager.tables
    e.block_manager.check_invariants()
    # What suffix decoding keeps after them is their outputs, and nothing else.
    suffixes = e.scheduler.speculator.suffixes
    assert (suffixes is None) == (method == "ngram")
    if suffixes is not None:
        assert len(suffixes.entries) == 6 and len(suffixes.corpora[(None, None)]) == 6


def test_seeded_sampled_requests_give_the_same_tokens_with_guesses_as_without(default_model, prompts):
    samplings = [SamplingParams(max_tokens=40, temperature=0.8, seed=i) for i in range(6)]
    plain = run(engine(default_model, "none", None), prompts[:6], samplings)
    guessing = engine(default_model, "none", NGRAM)
    guessed = run(guessing, prompts[:6], samplings)
    assert guessing.stats.spec_accepted_tokens > 0
    assert [o.new_token_ids for o in guessed] == [o.new_token_ids for o in plain]


SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
GRAMMARS = [GrammarSpec.json_schema(SCHEMA), GrammarSpec("json"), GrammarSpec("regex", r"[A-Za-z ,.'\n]{1,300}")]


def constrained(e: Engine, prompts: list[list[int]], samplings: list[SamplingParams], specs) -> list[list[int]]:
    """Each prompt decoded under its grammar, all at once; the tokens of each."""
    requests = []
    for prompt, sampling, spec in zip(prompts, samplings, specs, strict=True):
        request = e.new_request(prompt, sampling)
        request.grammar = e.grammars.constraint(e.grammars.compile(spec), spec)
        e.submit(request, lambda _: None)
        requests.append(request)
    for _ in range(10 * max(s.max_tokens for s in samplings)):  # bounded: each step gives every row a token
        if all(r.is_finished for r in requests):
            break
        e.step()
    assert all(r.is_finished for r in requests)
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_under_a_grammar_guess_and_keep_the_tokens_decoding_gives(default_model, prompts, temperature):
    grounded = prompts[:6]
    samplings = [SamplingParams(max_tokens=40, temperature=temperature, seed=i) for i in range(6)]
    specs = [GRAMMARS[i % len(GRAMMARS)] for i in range(6)]
    plain = constrained(engine(default_model, "none", None), grounded, samplings, specs)
    guessing = engine(default_model, "none", NGRAM)
    guessed = constrained(guessing, grounded, samplings, specs)
    assert guessed == plain
    assert guessing.stats.spec_accepted_tokens > 0


def test_a_guess_the_grammar_forbids_is_rejected_where_the_model_would_keep_it(default_model):
    """The model copies the prompt, so its own choice after "1 2 3" is " apple", which is
    also the guess; the grammar allows only digits and spaces, and decoding under it never
    writes " apple": neither may guessing. (Digits and spaces are a token each here: six
    guesses after "1" reach the word.)"""
    tok = default_model.tokenizer
    text = "1 2 3 apple 4 5 6 pear 7 8 9 plum 1 2 3 apple 4 5 6 pear 7 8 9 plum"
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly:\n{text}"}])
    sampling = [SamplingParams(max_tokens=32, temperature=0)]
    spec = [GrammarSpec("regex", r"[0-9 ]{1,64}")]
    plain = constrained(engine(default_model, "none", None), [prompt], sampling, spec)
    guessing = engine(default_model, "none", SpeculativeConfig(method="ngram", num_speculative_tokens=6))
    guessed = constrained(guessing, [prompt], sampling, spec)
    assert guessed == plain
    assert re.fullmatch(r"[0-9 ]+", tok.decode(guessed[0], skip_special_tokens=True))
    stats = guessing.stats
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens  # guesses were made, and refused


def test_penalties_and_min_tokens_give_the_same_tokens_with_guesses_as_without(default_model, prompts):
    """Rows whose distribution moves with their own tokens: each guessed position is
    penalised (and held from ending) as if the guesses before it were kept."""
    grounded = prompts[:6]
    samplings = [
        SamplingParams(max_tokens=40, temperature=0, frequency_penalty=0.4),
        SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.6),
        SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.15),
        SamplingParams(max_tokens=40, temperature=0, min_tokens=30),
        SamplingParams(max_tokens=40, temperature=0.8, seed=5, frequency_penalty=0.3, repetition_penalty=1.1),
        SamplingParams(max_tokens=40, temperature=0.8, seed=6, min_tokens=35),
    ]
    plain = run(engine(default_model, "none", None), grounded, samplings)
    guessing = engine(default_model, "none", NGRAM)
    guessed = run(guessing, grounded, samplings)
    assert [o.new_token_ids for o in guessed] == [o.new_token_ids for o in plain]
    assert guessing.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_the_model_as_its_own_draft_has_every_guess_kept(models, prompts, quantization):
    """The draft decodes what the target would: in float32 every guess is kept, but those
    after a guessed end of sequence or a loop found amid them (the row's tokens end there).
    Quantised, the int kernels choose their arithmetic by the rows in a matmul (a small
    batch's kernel, a large one's float path), and the draft's batches are not the
    target's: a few near-ties fall the other way (761 of 813 kept on a Zen 5); at least 90%
    must be. The tokens are decoding's either way."""
    plain, steps = decoded(models, prompts, quantization)
    draft = SpeculativeConfig(method="draft_model", model=default_model_path(), num_speculative_tokens=4)
    guessing = engine(models[quantization], quantization, draft)
    assert guessing.scheduler.speculator.drafter.executor.loaded is models[quantization]  # its weights, once
    requests = []
    for start in range(0, len(prompts), GROUP):
        requests += guessing.generate(prompts[start : start + GROUP], GREEDY)
    assert [r.output_token_ids for r in requests] == [o.new_token_ids for o in plain]
    stats = guessing.stats
    if quantization == "none":
        for r in requests:
            dropped = r.resources.num_draft_tokens - r.resources.num_accepted_tokens
            ended = r.status.finish_reason == "stop" or r.loop_detected_at is not None
            assert dropped == 0 or (ended and dropped < 4), r.request_id
    else:
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens
    assert stats.spec_accepted_tokens >= 500 and stats.steps < steps / 2
    drafter = guessing.scheduler.speculator.drafter
    assert not drafter.sequences and drafter.blocks.num_used_blocks == 0


def test_a_draft_that_disagrees_changes_no_token(models, prompts):
    """The quantised model drafting for the float32 one: some guesses are refused, the
    tokens are float32 decoding's."""
    plain, _ = decoded(models, prompts, "none")
    guessing = engine(models["none"], "none", None)
    drafting = SpeculativeConfig(method="draft_model", model=default_model_path())
    speculator = Speculator(drafting, guessing.scheduler.cost)
    speculator.priced = False
    config = Config(model=ModelConfig(quantization="auto"), cache=guessing.config.cache)
    speculator.drafter = Drafter(Executor.build(config, models["auto"]))
    guessing.scheduler.speculator = speculator
    guessed = run(guessing, prompts, GREEDY)
    assert [o.new_token_ids for o in guessed] == [o.new_token_ids for o in plain]
    stats = guessing.stats
    assert stats.spec_accepted_tokens > 200 and stats.spec_draft_tokens > stats.spec_accepted_tokens


def test_the_drafts_cache_is_trusted_only_up_to_the_first_guess_not_kept(default_model, prompts):
    """After the target keeps one guess of four and then takes a token of its own, the
    draft's next guesses are those of a draft that never saw the refused ones; after it
    keeps every guess it was given, those of a draft that computed them all."""

    def drafter() -> Drafter:
        return Drafter(Executor.build(Config(cache=CacheConfig(num_blocks=64, block_size=16)), default_model))

    cached = drafter()
    request = Request("r", prompts[0], SamplingParams(max_tokens=64, temperature=0))
    [first] = cached.propose([(request, 4)])
    assert len(first.tokens) == 4
    request.append_output(first.tokens[0])  # kept
    request.append_output(first.tokens[1] + 1)  # the target's own, not the draft's second guess
    assert cached.pending(request) == 1  # the refused guesses are not its; the new token is to run
    assert drafter().pending(request) == request.num_tokens  # an unseen row: all of it
    [again] = cached.propose([(request, 4)])
    [fresh] = drafter().propose([(request, 4)])
    assert again.tokens == fresh.tokens
    # The price took two of four guesses, the target kept both and its own token is the
    # draft's third: the draft's cache holds all of them, and the newest is run again.
    request.append_output(again.tokens[0])
    request.append_output(again.tokens[1])
    request.append_output(again.tokens[2])
    assert cached.pending(request) == 1
    [third] = cached.propose([(request, 4)])
    [fresh] = drafter().propose([(request, 4)])
    assert third.tokens == fresh.tokens and len(third.tokens) == 4
    # All four kept, then the target's own: the last guess never ran through the draft, so
    # it is two behind (speculation.py's CAUGHT_UP).
    for token in third.tokens:
        request.append_output(token)
    request.append_output(third.tokens[0])
    assert cached.pending(request) == 2
    cached.forget("r")
    assert cached.blocks.num_used_blocks == 0 and not cached.sequences
