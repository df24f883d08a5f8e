"""The prefix cache never shares blocks across adapters: a block's key is salted with the
adapter it was computed under (its load's uid), so the same prompt under another adapter,
under the base, or under a name reloaded since, computes its K/V afresh; under the same
adapter it hits."""

from __future__ import annotations

import pytest

from headroom.config import CacheConfig, Config
from headroom.contracts.request import AdapterRef, Request, SamplingParams
from headroom.runtime.block_manager import BlockManager, block_key
from headroom.runtime.engine import Engine

BS = 16
SYSTEM = (
    "You are a careful assistant for a small public library. You answer questions about opening hours, "
    "loans, renewals, fines and the reading rooms, briefly and politely, and you say so when you do not know."
)

# ---- the block manager alone --------------------------------------------------------------

A, A_RELOADED, B = AdapterRef("a", 1), AdapterRef("a", 3), AdapterRef("b", 2)
TOKENS = list(range(100, 113))  # 13 tokens: 3 full blocks of 4, the last token left to compute


def computed(manager: BlockManager, request_id: str, lora: AdapterRef | None) -> Request:
    """A request whose 13 tokens were computed and whose full blocks were keyed."""
    request = Request(request_id, TOKENS, SamplingParams(), lora=lora)
    table = manager.allocate_slots(request, len(TOKENS), manager.get_computed_blocks(request))
    assert table is not None
    request.num_computed_tokens = len(TOKENS)
    manager.cache_full_blocks(request)
    return request


def probe(manager: BlockManager, lora: AdapterRef | None) -> list[int]:
    return manager.get_computed_blocks(Request("probe", TOKENS, SamplingParams(), lora=lora))


def test_block_manager_keys_blocks_per_adapter():
    manager = BlockManager(num_blocks=16, block_size=4)
    computed(manager, "r-a", A)
    table = manager.block_table("r-a")
    assert len(table) == 4
    # Three full blocks keyed, the first salted with the adapter's key.
    assert manager.blocks[table[0]].key == block_key(b"lora:1", TOKENS[:4])
    assert manager.blocks[table[0]].key != block_key(None, TOKENS[:4])
    assert manager.blocks[table[1]].key == block_key(block_key(b"lora:1", TOKENS[:4]), TOKENS[4:8])
    assert manager.blocks[table[3]].key is None  # the partial block
    assert len(manager.cached) == 3

    assert probe(manager, A) == table[:3]
    assert probe(manager, AdapterRef("a", 1)) == table[:3]  # equal refs, equal keys
    assert probe(manager, B) == []
    assert probe(manager, None) == []
    assert probe(manager, A_RELOADED) == []  # the same name, loaded again: other weights
    assert probe(manager, AdapterRef("other-name", 1)) == table[:3]  # the uid is the salt, not the name

    # The base's blocks and B's are their own, and each finds only its own.
    computed(manager, "r-base", None)
    computed(manager, "r-b", B)
    base_table, b_table = manager.block_table("r-base"), manager.block_table("r-b")
    assert len(set(table) | set(base_table) | set(b_table)) == 12  # nothing shared
    assert probe(manager, None) == base_table[:3]
    assert probe(manager, B) == b_table[:3]
    assert probe(manager, A) == table[:3]
    assert manager.blocks[base_table[0]].key == block_key(None, TOKENS[:4])
    assert len(manager.cached) == 9
    manager.check_invariants()

    # A second request under A takes A's blocks (shared), and only those.
    again = computed(manager, "r-a2", A)
    assert manager.block_table("r-a2")[:3] == table[:3]
    assert [manager.blocks[b].ref_count for b in table[:3]] == [2, 2, 2]
    assert again.num_computed_tokens == len(TOKENS)
    manager.check_invariants()

    for request_id in ("r-a", "r-base", "r-b", "r-a2"):
        manager.free_request(request_id)
    assert manager.num_used_blocks == 0
    # Freed blocks stay findable, each under its own adapter only.
    assert probe(manager, A) == table[:3]
    assert probe(manager, None) == base_table[:3]
    assert probe(manager, A_RELOADED) == []
    manager.check_invariants()


def test_block_manager_chain_after_a_hit_stays_salted():
    """A request that starts from cached blocks keys its later blocks from the chain it
    hit, so they too are found only under its adapter."""
    manager = BlockManager(num_blocks=16, block_size=4)
    computed(manager, "r-a", A)
    longer = [*TOKENS, *range(200, 208)]  # 21 tokens: 5 full blocks
    request = Request("r-long", longer, SamplingParams(), lora=A)
    hits = manager.get_computed_blocks(request)
    assert len(hits) == 3
    assert manager.allocate_slots(request, len(longer) - 12, hits) is not None
    request.num_computed_tokens = len(longer)
    manager.cache_full_blocks(request)
    table = manager.block_table("r-long")
    assert len(manager.cached) == 5
    assert manager.get_computed_blocks(Request("p", [*longer, 1], SamplingParams(), lora=A)) == table[:5]
    assert manager.get_computed_blocks(Request("p", [*longer, 1], SamplingParams(), lora=B)) == []
    assert manager.get_computed_blocks(Request("p", [*longer, 1], SamplingParams())) == []
    manager.free_request("r-a")
    manager.free_request("r-long")
    assert manager.num_used_blocks == 0
    manager.check_invariants()


# ---- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt(default_model) -> list[int]:
    tok = default_model.tokenizer
    ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hours?"}])
    assert len(ids) >= 48
    return ids


def engine_with(default_model, adapter_dirs) -> Engine:
    lora = [f"a={adapter_dirs['attn-r8']}", f"b={adapter_dirs['all-r4-rs']}"]
    engine = Engine(Config(cache=CacheConfig(block_size=BS), lora=lora), loaded=default_model)
    assert engine.block_manager.block_size == BS and engine.block_manager.enable_prefix_caching
    return engine


def run(engine: Engine, prompt: list[int], lora: str | None) -> Request:
    (request,) = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), lora=[lora])
    assert request.num_output_tokens == 2
    assert request.lora == (None if lora is None else engine.executor.loras.ref(lora))
    return request


@pytest.mark.slow
def test_engine_never_shares_blocks_across_adapters(default_model, adapter_dirs, prompt):
    engine = engine_with(default_model, adapter_dirs)
    hit = BS * ((len(prompt) - 1) // BS)  # every full block of the prompt, short of its last token
    assert hit >= 32

    first_a = run(engine, prompt, "a")
    assert first_a.num_cached_tokens == 0
    assert run(engine, prompt, "b").num_cached_tokens == 0
    assert run(engine, prompt, None).num_cached_tokens == 0
    again_a = run(engine, prompt, "a")
    assert again_a.num_cached_tokens == hit
    assert again_a.output_token_ids == first_a.output_token_ids  # A's own K/V, reused
    # Each one's blocks are there for itself: B and the base hit their own.
    assert run(engine, prompt, "b").num_cached_tokens == hit
    assert run(engine, prompt, None).num_cached_tokens == hit
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


@pytest.mark.slow
def test_engine_reloaded_name_misses_the_old_blocks(default_model, adapter_dirs, prompt):
    """A name unloaded and loaded again (here with the very same folder) gets a new uid,
    so the blocks of its former load are never served to it."""
    engine = engine_with(default_model, adapter_dirs)
    hit = BS * ((len(prompt) - 1) // BS)
    first = run(engine, prompt, "a")
    assert first.num_cached_tokens == 0 and first.lora.uid == 1
    future = engine.unload_lora("a")
    engine.step()  # applies the unload
    assert future.result(timeout=0) is None
    assert engine.executor.loras.ref("a") is None
    ref = engine.executor.loras.load("a", adapter_dirs["attn-r8"])
    assert ref.uid == 3 and ref.key() != first.lora.key()
    reloaded = run(engine, prompt, "a")
    assert reloaded.lora == ref
    assert reloaded.num_cached_tokens == 0
    assert reloaded.output_token_ids == first.output_token_ids  # the same weights, computed afresh
    assert run(engine, prompt, "a").num_cached_tokens == hit
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
