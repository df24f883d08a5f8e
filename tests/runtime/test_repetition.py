"""Loop detection: the incremental tracker gives vLLM's answer, a request's own
repetition_detection ends it at the token where the pattern completes, and the server's
loop policy flags, caps or stops a looping sequence once, leaving alone sequences that do
not loop, that ask for every token (ignore_eos) or that bring their own detection."""

from __future__ import annotations

import json
import logging
import random

import pytest

from headroom.config import (
    AdminConfig,
    CacheConfig,
    Config,
    ConfigError,
    SchedulerConfig,
    SpeculativeConfig,
    TenantConfig,
)
from headroom.contracts.repetition import LoopTracker, RepetitionDetection, first_detection
from headroom.contracts.request import AdmissionRecord, SamplingParams
from headroom.executor.grammar import GrammarSpec
from headroom.runtime.engine import Engine


def vllm_check(tokens: list[int], max_size: int, min_size: int, min_count: int) -> bool:
    """vLLM's check_sequence_repetition, as its documentation defines it: the last
    size * min_count tokens are min_count copies of one pattern, for a size in range."""
    for size in range(max(min_size, 1), max_size + 1):
        if size * min_count > len(tokens):
            return False
        tail = tokens[len(tokens) - size * min_count :]
        if tail == tail[:size] * min_count:
            return True
    return False


def test_the_tracker_fires_exactly_where_vllms_check_first_does():
    rng = random.Random(7)
    fired = 0
    for _ in range(2000):
        size = rng.randint(1, 8)
        params = (size, rng.randint(0, size), rng.randint(2, 5))
        tokens = [rng.randint(0, 2) for _ in range(rng.randint(1, 48))]
        expected = next((n for n in range(1, len(tokens) + 1) if vllm_check(tokens[:n], *params)), None)
        found = first_detection(tokens, RepetitionDetection(*params))
        assert (found and found[0]) == expected, (tokens, params)
        fired += expected is not None
    assert 200 < fired < 1800  # both outcomes were exercised


def test_the_tracker_reports_the_smallest_repeating_pattern():
    tracker, seen = LoopTracker(8), []
    for token in [5, 1, 2, 3, 1, 2, 3, 1, 2, 3]:
        seen.append(token)
        tracker.push(seen)
    assert tracker.period(RepetitionDetection(8, 1, 3)) == 3
    assert tracker.period(RepetitionDetection(8, 1, 2)) == 3  # sizes 1 and 2 do not repeat
    assert tracker.period(RepetitionDetection(8, 4, 2)) is None  # size 6 twice needs 12 tokens
    assert tracker.period(RepetitionDetection(8, 1, 4)) is None  # three copies, not four


@pytest.mark.parametrize(
    "params, error",
    [
        ((0, 0, 2), "max_pattern_size must be in [1, 256], got 0"),
        ((257, 0, 2), "max_pattern_size must be in [1, 256], got 257"),
        ((4, 5, 2), "min_pattern_size must be in [0, max_pattern_size], got 5"),
        ((4, 1, 1), "min_count must be >= 2, got 1"),
    ],
)
def test_bad_parameters_are_refused(params, error):
    with pytest.raises(ValueError) as info:
        RepetitionDetection(*params)
    assert str(info.value) == error


def test_bad_loop_policies_are_refused_in_the_config():
    with pytest.raises(ConfigError, match="admin.loop_policy must be one of off, flag, cap, stop, got 'kill'"):
        AdminConfig(loop_policy="kill")
    with pytest.raises(ConfigError, match="tenant 't': ladder: every step must be one of deprioritize, cap, abort"):
        TenantConfig("t", ladder=("deprioritize", "stop"))
    with pytest.raises(ConfigError, match=r"admin.loop_\*: min_count must be >= 2, got 0"):
        AdminConfig(loop_min_count=0)


# ---- in the engine ------------------------------------------------------------------------


def make_engine(default_model, speculative: bool = False, **admin) -> Engine:
    """speculative: n-gram guesses wherever a row can take them (unpriced)."""
    config = Config(
        cache=CacheConfig(num_blocks=64, block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=4),
        admin=AdminConfig(**admin),
        speculative=SpeculativeConfig(method="ngram" if speculative else "off"),
    )
    engine = Engine(config, loaded=default_model)
    if speculative:
        engine.scheduler.speculator.priced = False
    return engine


@pytest.fixture(scope="module")
def prompt(default_model) -> list[int]:
    return default_model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])


@pytest.fixture(scope="module")
def the(default_model) -> int:
    return default_model.tokenizer.encode(" the")[-1]


def test_a_requests_own_detection_ends_it_where_the_pattern_completes(default_model, prompt, the):
    engine = make_engine(default_model, loop_policy="off")
    # The bias makes every token " the": a pattern of one token, and of every size above.
    looping = SamplingParams(
        max_tokens=64, temperature=0.0, logit_bias=((the, 100.0),), repetition_detection=RepetitionDetection(4, 2, 3)
    )
    late = SamplingParams(
        max_tokens=64,
        temperature=0.0,
        logit_bias=((the, 100.0),),
        min_tokens=10,
        repetition_detection=RepetitionDetection(4, 1, 3),
    )
    first, second = engine.generate([prompt, prompt], [looping, late])
    # Size 2 ("the the") three times: the 6th token; size 1 would have fired at the 3rd.
    assert first.output_token_ids == [the] * 6
    assert first.status.finish_reason == "repetition" and first.stop_reason == "repetition_detected"
    # Not before min_tokens, as vLLM.
    assert second.output_token_ids == [the] * 10
    assert second.status.finish_reason == "repetition"
    assert engine.stats.loops == {}  # the server's policy was off
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "policy, finish, tokens", [("flag", "length", 40), ("cap", "length", 4 + 5), ("stop", "repetition", 4)]
)
def test_the_servers_policy_acts_once_at_the_step_the_detector_fires(
    default_model, prompt, the, caplog, policy, finish, tokens
):
    engine = make_engine(
        default_model,
        loop_policy=policy,
        loop_max_pattern_size=8,
        loop_min_pattern_size=1,
        loop_min_count=4,
        cap_tokens=5,
    )
    caplog.set_level(logging.WARNING, logger="headroom.runtime.actions")
    [looping] = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, logit_bias=((the, 100.0),)))
    assert looping.output_token_ids == [the] * tokens
    assert looping.status.finish_reason == finish
    assert (looping.loop_period, looping.loop_detected_at) == (1, 4)
    what = "a 1-token pattern repeated 4 times at 4 output tokens"
    expected_action = {
        "flag": f"flag by loop detector: {what}",
        "cap": f"cap by loop detector at 9 tokens: {what}",
        "stop": f"stop by loop detector: {what}",
    }[policy]
    assert looping.admin_actions == [expected_action]
    assert looping.stop_reason == (None if policy == "flag" else "loop_detected")
    assert engine.stats.loops == {policy: 1}
    assert [
        r.getMessage() for r in caplog.records if r.name == "headroom.runtime.actions" and "loop" in r.getMessage()
    ] == [f"loop {policy} on {looping.request_id}: {what}"]
    assert engine.block_manager.num_used_blocks == 0


def test_a_sequence_that_does_not_loop_is_never_touched(default_model, prompt):
    off = make_engine(default_model, loop_policy="off")
    [reference] = off.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0))
    assert reference.status.finish_reason == "stop"  # it ends on its own
    engine = make_engine(default_model, loop_policy="stop")
    [answer] = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0.0))
    assert answer.output_token_ids == reference.output_token_ids
    assert answer.status.finish_reason == "stop" and answer.admin_actions == []
    assert answer.loop_detected_at is None and engine.stats.loops == {}


def test_ignore_eos_and_a_requests_own_detection_are_left_to_the_request(default_model, prompt, the):
    engine = make_engine(
        default_model, loop_policy="stop", loop_max_pattern_size=8, loop_min_pattern_size=1, loop_min_count=4
    )
    bias = ((the, 100.0),)
    every, own = engine.generate(
        [prompt, prompt],
        [
            SamplingParams(max_tokens=24, temperature=0.0, logit_bias=bias, ignore_eos=True),
            SamplingParams(
                max_tokens=24, temperature=0.0, logit_bias=bias, repetition_detection=RepetitionDetection(8, 1, 10)
            ),
        ],
    )
    assert every.output_token_ids == [the] * 24 and every.status.finish_reason == "length"
    assert own.output_token_ids == [the] * 10 and own.status.finish_reason == "repetition"
    assert every.admin_actions == own.admin_actions == [] and engine.stats.loops == {}


def test_a_tenants_policy_overrides_the_servers(default_model, prompt, the):
    engine = make_engine(
        default_model, loop_policy="flag", loop_max_pattern_size=8, loop_min_pattern_size=1, loop_min_count=4
    )
    request = engine.new_request(prompt, SamplingParams(max_tokens=40, temperature=0.0, logit_bias=((the, 100.0),)))
    request.admission = AdmissionRecord(loop_policy="stop")  # what the admission gate copies from the tenant's config
    outputs = []
    engine.submit(request, outputs.append)
    while not request.is_finished:
        engine.step()
    assert request.output_token_ids == [the] * 4 and request.status.finish_reason == "repetition"
    assert outputs[-1].finish_reason == "repetition" and outputs[-1].stop_reason == "loop_detected"
    assert engine.stats.loops == {"stop": 1}


@pytest.mark.parametrize(
    ("loop_policy", "speculative"), [("stop", False), ("cap", False), ("flag", False), ("stop", True)]
)
def test_a_loop_under_a_grammar_is_closed_into_valid_json_not_cut(default_model, prompt, the, loop_policy, speculative):
    """The bias makes the model write " the" for ever inside a JSON string. Cutting it would
    leave invalid JSON; the detector instead steers it to close the string, and the grammar
    then closes the object: valid JSON, finish "stop", whatever the loop policy. With
    guesses (the loop is guessed several tokens a step), the finding comes at the same
    token, the tokens guessed after it are dropped and the grammar's matcher set back."""
    engine = make_engine(default_model, speculative, loop_policy=loop_policy)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    request = engine.new_request(prompt, SamplingParams(max_tokens=120, temperature=0.0, logit_bias=((the, 100.0),)))
    spec = GrammarSpec.json_schema(schema)
    request.grammar = engine.grammars.constraint(engine.grammars.compile(spec), spec)
    engine.submit(request, lambda _: None)
    while not request.is_finished:
        engine.step()
    text = engine.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
    assert request.status.finish_reason == "stop", text
    detection = engine.config.admin.loop_detection
    # " the" repeated fires every period at once: 8 tokens seen 4 times, 32 in all.
    repeats = detection.min_pattern_size * detection.min_count
    start = request.output_token_ids.index(the)  # after '{"name": "'
    fired_at = start + repeats
    assert request.output_token_ids[start:fired_at] == [the] * repeats
    # The very next token closed the string, and the grammar the object.
    assert json.loads(text) == {"name": " the" * repeats}
    # Closed, so neither a violation for the policies nor a loop in the predictor's labels.
    assert engine.stats.loops == {"close": 1} and request.grammar.closed == 1
    assert (engine.stats.spec_accepted_tokens > 0) == speculative
    assert request.loop_detected_at is None
    assert request.admin_actions == [
        f"close the value by loop detector: a 8-token pattern repeated 4 times at {fired_at} output tokens"
    ]


def test_a_grammar_that_cannot_close_runs_to_its_length(default_model, prompt, the):
    """A regex grammar is not steered (a quote or a comma means nothing to it), nor cut: the
    loop goes on to max_tokens and is reported as length, never cut into a stop."""
    engine = make_engine(default_model, loop_policy="stop")
    request = engine.new_request(prompt, SamplingParams(max_tokens=48, temperature=0.0, logit_bias=((the, 100.0),)))
    spec = GrammarSpec("regex", "( the)+")
    request.grammar = engine.grammars.constraint(engine.grammars.compile(spec), spec)
    engine.submit(request, lambda _: None)
    while not request.is_finished:
        engine.step()
    assert request.status.finish_reason == "length" and request.num_output_tokens == 48
    assert engine.tokenizer.decode(request.output_token_ids) == " the" * 48
    assert engine.stats.loops == {} and request.grammar.closed == 0
