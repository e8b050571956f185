"""Logical KV blocks: allocation, reference counts and chained-hash prefix reuse. No torch.

A full block is identified by a keyed hash (blake2b, a random key per process) of the previous block's
digest, adapter key and its token ids, so a hit on block i implies blocks 0..i-1 match too; the first
block hashes the request's cache salt in place of a previous digest. A hit also checks the block's own
tokens and parent digest. Python's hash() would not do: tuples of ints hash alike in every process and
collide by construction (hash(t) == hash(t + 2**61 - 1)), so a chosen prompt could land on a block
computed after another prefix and read its KV (vLLM's CVE-2025-25183). Freed blocks keep their hash and stay reusable until
the allocator needs them again, oldest-freed first (LRU).

A block is registered when it is scheduled to be filled, not after: within one forward pass every
layer writes all of the step's keys and values into the cache before any query attends, so a request
admitted later in the same step can already attend to it. A burst of requests with one system prompt
computes that prompt once (as vLLM's V1 scheduler does).

When every layer of the model attends within a sliding window (`window`), the blocks whose positions
all lie behind it are dropped from the sequence as it advances: their block table entries become
FREED (positions keep their blocks' indices) and the blocks go back to the pool, keeping their
cached content like any freed block. The model runner gathers context from the first live block on.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict

from rayllm.engine.sequence import Sequence

FREED = -1  # a block table entry whose block fell behind every layer's window and went back to the pool
# Keyed per process, so digests cannot be precomputed elsewhere; copied per block (cheaper than keying anew).
_KEYED = hashlib.blake2b(key=os.urandom(32), digest_size=16)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.parent: bytes | None = None  # the previous block's digest (None: the first block)
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None) -> None:
        """window: every layer's keys lie within this many positions of the query (registry.kv_window);
        None keeps every block of a sequence until it finishes."""
        self.block_size = block_size
        self.window = window
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first; cached content is evicted from the front.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up, for the hit-rate metric
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    @staticmethod
    def _block_hash(prev: bytes | None, seq: Sequence, tokens: tuple[int, ...]) -> bytes:
        # The first block carries the sequence's cache salt (its tenant); later blocks inherit it through
        # the chain, so sequences with different salts never share a block and cannot probe each other's
        # prompts through cached-token counts or timing. Each field is tagged or fixed-size: no two
        # different inputs serialise alike.
        if prev is None:
            salt = None if seq.params.cache_salt is None else seq.params.cache_salt.encode()
            head = b"\0" if salt is None else b"\1" + len(salt).to_bytes(8, "little") + salt
        else:
            head = b"\2" + prev
        h = _KEYED.copy()
        h.update(head + seq.lora_slot.to_bytes(8, "little", signed=True) + array("q", tokens).tobytes())
        return h.digest()

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence; returns tokens reused.

        At least one token is always left to compute, since the last position's logits are needed.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        self.prefix_queries += seq.num_tokens
        prev: bytes | None = None
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._block_hash(prev, seq, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != prev:
                break
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        reused = len(seq.block_table) * bs
        self.prefix_hits += reused
        seq.num_computed_tokens = reused
        return reused

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once, computed chunk_tokens at a time."""
        blocks = -(-num_tokens // self.block_size)
        if self.window is None:
            return blocks
        # The window behind the chunk's first query, the chunk, and a partial block at either end.
        return min(blocks, -(-(self.window - 1 + chunk_tokens) // self.block_size) + 1)

    def _drop_behind_window(self, seq: Sequence) -> None:
        """Free the blocks no query from num_computed_tokens on can see (position <= that - window)."""
        if self.window is None:
            return
        dead = (seq.num_computed_tokens - self.window + 1) // self.block_size
        for i in range(min(dead, len(seq.block_table)) - 1, -1, -1):
            if seq.block_table[i] == FREED:  # freed at an earlier step, and so is everything before it
                break
            block = self.blocks[seq.block_table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block.block_id] = None
            seq.block_table[i] = FREED

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make the block table cover num_computed_tokens + num_new_tokens (first dropping the blocks
        behind a window); False if out of blocks."""
        self._drop_behind_window(seq)
        needed_blocks = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        missing = needed_blocks - len(seq.block_table)
        if missing > len(self.free_blocks):
            return False
        for _ in range(missing):
            block_id, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:  # evict its cached content
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash = None
                block.token_ids = ()
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def commit_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once the first `num_tokens` tokens are computed (this
        step included: see the module docstring), so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = num_tokens // bs
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self._block_hash(prev, seq, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash = h
                block.parent = prev
                block.token_ids = tokens
                self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)
            prev = h

    def reset_prefix_cache(self) -> int:
        """Forget the cached content of every free block (in-use blocks keep theirs); returns how many.
        For benchmarks that repeat prompts, and for operators after changing weights."""
        dropped = 0
        for block_id in self.free_blocks:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash = None
                block.token_ids = ()
                dropped += 1
        return dropped

    def free(self, seq: Sequence) -> None:
        # Tail blocks go into the free queue first, so they are evicted before the shared prefix.
        for block_id in reversed(seq.block_table):
            if block_id == FREED:  # dropped behind the window: already back in the pool
                break
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
