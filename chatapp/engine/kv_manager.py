"""Per-request block tables on top of the block pool, and prefix-cache lookups.

Each request owns a list of blocks (its block table, logical -> physical).
Blocks are allocated only for tokens about to be computed, so a request holds
at most one partly filled block. Full blocks whose tokens are computed are
registered in the prefix cache under their chained hash.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatapp.engine.block_pool import BlockPool, KVBlock
from chatapp.engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM does: queries are prompt tokens looked up, hits were found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # how many leading blocks are registered
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least the last known token is always left to compute, so the model
        produces logits to sample from even when the whole prompt is cached.
        """
        if not self.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_prefix: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if full.

        ``cached_prefix`` is the result of :meth:`find_cached_prefix` for a
        request being admitted; its blocks are shared, not copied.
        """
        cached_prefix = cached_prefix or []
        owned = self._blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(owned) - len(cached_prefix)
        # Touching a cached block that nobody holds takes it out of the free queue.
        reclaimed = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            if not owned:
                del self._blocks[request.request_id]
            return False
        if cached_prefix:
            self.pool.touch(cached_prefix)
            owned.extend(cached_prefix)
            self._num_cached[request.request_id] = len(cached_prefix)
        if needed > 0:
            owned.extend(self.pool.allocate(needed))
        return True

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_caching:
            return
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        start = self._num_cached.get(request.request_id, 0)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, num_full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(start, num_full)

    def free(self, request_id: str) -> None:
        """Give back a request's blocks, once; tail blocks first so shared prefixes are evicted last."""
        blocks = self._blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    @property
    def num_requests(self) -> int:
        return len(self._blocks)
