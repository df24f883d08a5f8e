"""Paged KV blocks: a free list, per-request block tables, reference counts and a
prefix cache of full blocks keyed by a hash chain of their tokens. Pure Python.

A full block's key hashes its parent's key with its own tokens, so equal keys mean
equal prefixes. A freed block keeps its key and stays findable until it is handed out
again: free blocks are evicted least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from headroom.contracts.request import Request


def block_key(parent: bytes | None, token_ids: list[int]) -> bytes:
    # A cryptographic hash: tenants share the cache, so a crafted collision must not let
    # one tenant's prompt read another's K/V.
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def _root(request: Request) -> bytes | None:
    """The parent of a request's first block: its adapter's, so that blocks computed under
    one adapter (or the base) are never served to another."""
    return request.lora.key() if request.lora is not None else None


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first free block is handed out first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.tables: dict[str, list[int]] = {}
        # Per request: how many leading blocks are keyed, and the key of the last one.
        self.chains: dict[str, tuple[int, bytes | None]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def block_table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks holding a prefix of the request's tokens. The last token is
        always left to compute, since sampling needs its logits."""
        if not self.enable_prefix_caching:
            return []
        bs, tokens = self.block_size, request.all_token_ids
        hits: list[int] = []
        key = _root(request)
        for i in range((len(tokens) - 1) // bs):
            key = block_key(key, tokens[i * bs : (i + 1) * bs])
            block_id = self.cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold num_new_tokens more tokens, after taking
        computed_blocks (prefix-cache hits, only on a request's first allocation).
        Returns the new table, or None (and changes nothing) if it does not fit."""
        computed_blocks = computed_blocks or []
        table = self.tables.setdefault(request.request_id, [])
        assert not (computed_blocks and table), "prefix hits apply only to an empty table"
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(total) - len(table) - len(computed_blocks)
        revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks + revived > len(self.free):
            if not table:
                del self.tables[request.request_id]
            return None
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            table.append(block_id)
        if computed_blocks:
            self.chains[request.request_id] = (len(computed_blocks), self.blocks[computed_blocks[-1]].key)
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:  # evict it from the prefix cache
                del self.cached[block.key]
                block.key = None
            block.ref_count = 1
            table.append(block_id)
        return table

    def cache_full_blocks(self, request: Request) -> None:
        """Key every block that the request's computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        rid, bs = request.request_id, self.block_size
        table = self.tables[rid]
        done, key = self.chains.get(rid, (0, _root(request)))
        full = min(request.num_computed_tokens // bs, len(table))
        if full <= done:
            return
        tokens = request.all_token_ids
        for i in range(done, full):
            key = block_key(key, tokens[i * bs : (i + 1) * bs])
            block = self.blocks[table[i]]
            # A twin computed concurrently keeps the cache entry; this copy stays unkeyed
            # but the chain continues from the key, which is a property of the tokens.
            if key not in self.cached:
                block.key = key
                self.cached[key] = block.block_id
        self.chains[rid] = (full, key)

    def free_request(self, request_id: str) -> None:
        table = self.tables.pop(request_id, [])
        self.chains.pop(request_id, None)
        # Tail first: tails are least likely to be shared, so they are evicted first.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.key is None:
                    self.free.move_to_end(block_id, last=False)

    def check_invariants(self) -> None:
        owners = [0] * self.num_blocks
        for rid, table in self.tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice"
            for block_id in table:
                owners[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == owners[block.block_id], f"block {block.block_id} ref count"
            assert (block.ref_count == 0) == (block.block_id in self.free), f"block {block.block_id} free list"
            if owners[block.block_id] > 1:
                assert block.key is not None, f"block {block.block_id} shared but not a cached prefix"
            if block.key is not None:
                assert self.cached.get(block.key) == block.block_id, f"block {block.block_id} cache entry"
        assert len(self.cached) == sum(b.key is not None for b in self.blocks)
        assert len(self.free) + sum(o > 0 for o in owners) == self.num_blocks
