"""The pool of physical KV cache blocks, with reference counts and a prefix-cache index.

Blocks nobody references sit in a free queue. A freed block that holds cached
content stays findable by its hash until it is handed out again; the queue
hands out the least recently freed block first, so hot prefixes live longest.
Freed blocks with no cached content go to the front: they are worth nothing,
so they are reused before any cached block is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVBlock:
    """One physical block: ``block_id`` indexes the KV tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block; hands them out, takes them back, and indexes cached ones."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (front is reused first).
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the front of the free queue, evicting cached content."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; give the caller's order as the eviction order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash.

        When two requests computed the same new prefix in one step, the first
        one's block stays the cached copy and the second stays private.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block
        block.block_hash = block_hash

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None and self._cached.get(block_hash) is block:
            del self._cached[block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget all cached content (for example after the weights changed)."""
        for block in list(self._cached.values()):
            block.block_hash = None
        self._cached.clear()

    def check_invariants(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent (tests call this)."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} has a negative refcount")
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(f"{block} free-queue membership disagrees with its refcount")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"{block} claims a hash the index does not map to it")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"index maps a hash to {block}, which holds another")
