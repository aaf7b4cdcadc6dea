"""Paged KV block allocation with reference counts and prefix caching.

The KV pool is ``num_blocks`` blocks of ``block_size`` tokens (vLLM PagedAttention). A sequence owns a block
table; blocks are shared between sequences through reference counts. Prefix caching: once a block is full
and its KV computed, it is registered under a chained hash ``hash((parent_hash, tokens))`` (so a hit implies
the whole prefix matches); a later sequence whose leading full blocks hash (and compare) equal reuses them.
Freed blocks keep their hash and stay revivable until they are handed out again (LRU order).
"""

from __future__ import annotations

from collections import OrderedDict

from atomtool.serve.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block given its parent block's key."""
    return hash((parent, tokens))


class BlockManager:
    """Allocates KV blocks to sequences. All methods are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hits = 0  # tokens served from the prefix cache (stats; counted by the scheduler on admission)

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks ``seq`` needs to hold ``num_computed_tokens + num_new_tokens`` tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # -- prefix cache ------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks to a sequence that holds none; returns the number of cached tokens.

        At most ``num_tokens - 1`` tokens are matched, so the last token is always computed (its logits are
        needed). Sets ``seq.num_computed_tokens``. A sequence still computing prompt log-probs
        (``seq.needs_prompt_logprobs``) matches nothing: positions served from the cache have no hidden state
        to take logits from (vLLM skips the cache for such requests too); its blocks are still registered.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return 0
        bs = self.block_size
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            self._take(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent = h
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed full blocks (KV computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(seq.num_hashed_blocks, full):
            parent = seq.block_hashes[i - 1] if i > 0 else None
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, tokens)
            seq.block_hashes.append(h)
            if h not in self.hash_to_block:
                block = self.blocks[seq.block_table[i]]
                block.hash, block.token_ids = h, tokens
                self.hash_to_block[h] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # -- allocation --------------------------------------------------------------------------------
    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]
        block.ref_count += 1

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give ``seq`` enough blocks for ``num_new_tokens`` more tokens; False (nothing changed) if short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict its prefix-cache entry
                if self.hash_to_block.get(block.hash) == bid:
                    del self.hash_to_block[block.hash]
                block.hash = block.token_ids = None
            block.ref_count = 1
            seq.block_table.append(bid)
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks reaching zero become free (tail blocks evicted first)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
