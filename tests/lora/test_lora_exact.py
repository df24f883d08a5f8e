"""LoRA adapters in one mixed batch give, token for token, what transformers + peft give
each prompt alone (float32, the unquantised reference path), on both CPU attention paths."""

from __future__ import annotations

import shutil

import pytest

from headroom.config import Config, SchedulerConfig
from headroom.contracts.request import SamplingParams
from headroom.runtime.engine import Engine
from tests.lora.conftest import ADAPTERS, peft_model
from tests.reference import greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "List three fruits.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(adapter_dirs, prompts):
    """adapter -> its greedy tokens per prompt, from PeftModel and from merge_and_unload."""
    found = {}
    for name, path in adapter_dirs.items():
        model = peft_model(path)
        unmerged = [greedy(model, p, MAX_TOKENS) for p in prompts]
        merged = model.merge_and_unload()
        assert [greedy(merged, p, MAX_TOKENS) for p in prompts] == unmerged  # the two oracles agree
        found[name] = unmerged
    return found


@pytest.mark.parametrize("backend", ["cpu_paged", "torch"])
def test_mixed_batch_equals_peft(default_model, adapter_dirs, prompts, reference, backend):
    config = Config(attention_backend=backend, lora=[f"{n}={p}" for n, p in adapter_dirs.items()])
    engine = Engine(config, loaded=default_model)
    # Every adapter and the base side by side in one batch, adapters interleaved.
    rows = [(name, i) for i in range(len(prompts)) for name in [*ADAPTERS, None]]
    requests = engine.generate(
        [prompts[i] for _, i in rows],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        lora=[name for name, _ in rows],
    )
    base = {i: r.output_token_ids for (name, i), r in zip(rows, requests, strict=True) if name is None}
    for (name, i), request in zip(rows, requests, strict=True):
        if name is not None:
            assert request.output_token_ids == reference[name][i], (name, i)
            assert request.output_token_ids != base[i], f"{name} gave the base model's tokens on prompt {i}"
    assert engine.block_manager.num_used_blocks == 0


def test_adapters_that_leave_memory_come_back_exact(default_model, adapter_dirs, prompts, reference):
    """max_cpu_loras=1: each adapter's weights leave memory when another one runs, and are
    read again from their folder for its next step; every token is still peft's."""
    config = Config(
        scheduler=SchedulerConfig(max_loras=1, max_cpu_loras=1),
        lora=[f"{n}={p}" for n, p in adapter_dirs.items()],
    )
    engine = Engine(config, loaded=default_model)
    loras = engine.executor.loras
    assert list(loras.adapters) == [loras.ref(list(adapter_dirs)[-1]).uid]  # the last loaded, alone
    rows = [(name, i) for i in range(len(prompts)) for name in ADAPTERS]
    outputs = []
    requests = engine.generate(
        [prompts[i] for _, i in rows],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        sink=outputs.append,
        lora=[name for name, _ in rows],
    )
    assert [o.error for o in outputs if o.error] == []
    for (name, i), request in zip(rows, requests, strict=True):
        assert request.output_token_ids == reference[name][i], (name, i)
    firsts = list(dict.fromkeys((o.request_id, o.request.lora.name) for o in outputs))  # first-token order
    runs = [name for k, (_, name) in enumerate(firsts) if k == 0 or firsts[k - 1][1] != name]
    # max_loras=1 runs one adapter at a time: each run of another adapter read its folder
    # again, except a first run of the one loaded last.
    assert loras.reloads == len(runs) - (runs[0] == list(adapter_dirs)[-1]) >= len(ADAPTERS) - 1
    assert len(loras.adapters) == 1
    assert engine.block_manager.num_used_blocks == 0


def test_an_adapter_whose_folder_went_fails_alone(default_model, adapter_dirs, prompts, reference, tmp_path):
    """An adapter out of memory whose folder was deleted before its request came: the
    request fails with the reason at the step that first runs it, and the other adapter's
    request runs to the end."""
    gone = shutil.copytree(adapter_dirs["attn-r8"], tmp_path / "gone")
    config = Config(
        scheduler=SchedulerConfig(max_loras=1, max_cpu_loras=1),
        lora=[f"gone={gone}", f"mlp-r16={adapter_dirs['mlp-r16']}"],
    )
    engine = Engine(config, loaded=default_model)
    # The failure is remembered until the test forgets it below, however slow the machine:
    # with the default 5 s, a busy core let it lapse before the second request came.
    engine.executor.loras.unreadable_for_s = float("inf")
    shutil.rmtree(gone)  # "gone" left memory when mlp-r16 loaded after it
    outputs = []
    failed, kept = engine.generate(
        [prompts[0], prompts[0]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        sink=outputs.append,
        lora=["gone", "mlp-r16"],
    )
    errors = [o.error for o in outputs if o.error]
    assert errors == [f"the LoRA adapter could not be read: LoRA adapter folder not found: {gone}"]
    assert failed.output_token_ids == [] and failed.is_finished
    assert engine.stats.aborts == {"engine_error": 1}
    assert kept.output_token_ids == reference["mlp-r16"][0]
    assert engine.executor.loras.ref("gone") is not None  # still registered: an unload is the operator's call
    assert engine.block_manager.num_used_blocks == 0
    # The next request under it is refused at entry, with the same reason, before any step.
    steps, outputs = engine.stats.steps, []
    once = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    (refused,) = engine.generate([prompts[0]], once, sink=outputs.append, lora=["gone"])
    assert [o.error for o in outputs] == errors and refused.resources.num_processed_tokens == 0
    assert engine.stats.steps == steps and engine.stats.aborts == {"engine_error": 1}
    # Its folder back, and the failure forgotten (unreadable_for_s later): it serves again.
    shutil.copytree(adapter_dirs["attn-r8"], gone)
    engine.executor.loras.unreadable_for_s = 0.0
    (back,) = engine.generate([prompts[0]], once, lora=["gone"])
    assert back.output_token_ids == reference["attn-r8"][0]
    assert engine.executor.loras.failed_reads == {}


def test_an_adapter_whose_folder_went_while_it_waited_fails_alone_at_its_step(
    default_model, adapter_dirs, prompts, reference, tmp_path
):
    """An adapter out of memory (max_cpu_loras=1) whose request waits for the one slot, and
    its folder deleted meanwhile: the step that first runs it cannot read it again. Only
    its request fails, charged for that step; the base sequence in that same step and the
    other adapter's request give their exact tokens."""
    gone = shutil.copytree(adapter_dirs["attn-r8"], tmp_path / "gone")
    config = Config(
        scheduler=SchedulerConfig(max_loras=1, max_cpu_loras=1),
        lora=[f"gone={gone}", f"mlp-r16={adapter_dirs['mlp-r16']}"],
    )
    engine = Engine(config, loaded=default_model)
    loras = engine.executor.loras
    outputs, charged, observed = [], [], []
    engine.watch_hidden(frozenset({1}), lambda rows, hidden: observed.append(([id(r) for r in rows], len(hidden[1]))))

    def sink(output):
        outputs.append(output)
        if output.error:  # what its last output says it cost: the step that failed it included
            used = output.request.resources
            charged.append((used.num_processed_tokens, used.peak_blocks, used.device_time_s))
        if output.request.lora is not None and output.request.lora.name == "mlp-r16" and gone.exists():
            shutil.rmtree(gone)  # "gone" entered with "mlp-r16", and waits for its slot

    long = SamplingParams(max_tokens=3 * MAX_TOKENS, temperature=0.0, ignore_eos=True)  # past the failing step
    kept, failed, base = engine.generate(
        [prompts[0], prompts[0], prompts[0]],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 2 + [long],
        sink=sink,
        lora=["mlp-r16", "gone", None],
    )
    errors = [o.error for o in outputs if o.error]
    assert errors == [f"the LoRA adapter could not be read: LoRA adapter folder not found: {gone}"]
    assert failed.output_token_ids == [] and failed.abort_cause == "engine_error"
    assert engine.stats.aborts == {"engine_error": 1} and engine.stats.finished["error"] == 1
    ((processed, peak, device_s),) = charged
    assert processed == failed.num_prompt_tokens and peak > 0 and device_s > 0
    # Its rows were the base model's: a length probe never sees them, and the rest keep theirs.
    assert {i for rows, _ in observed for i in rows} == {id(kept), id(base)}
    assert all(len(rows) == n for rows, n in observed)
    assert kept.output_token_ids == reference["mlp-r16"][0]
    engine.watch_hidden(frozenset(), None)
    (alone,) = engine.generate([prompts[0]], long)
    assert base.output_token_ids == alone.output_token_ids and len(alone.output_token_ids) == 3 * MAX_TOKENS
    assert loras.reloads == 0  # "mlp-r16" never left memory; "gone" never read again
    assert loras.ref("gone") is not None  # still registered: an unload is the operator's call
    assert engine.block_manager.num_used_blocks == 0
