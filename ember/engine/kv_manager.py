"""Block allocation for the paged KV cache: a `BlockPool` per KV-cache group (free list, ref counts, prefix
hashes), a `KVCacheManager` per group, and `KVCacheCoordinator`, which keeps the groups in step."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ember.kv_spec import KVCacheGroup, KVCacheSpec  # noqa: F401  (re-exported)
from ember.engine.request import Request

NULL_BLOCK = 0   # never handed out: padding rows of block tables point here, and stray writes land here


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: it covers every token before it, so equal hashes mean equal prefixes."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    """Fixed set of blocks with reference counts. Free blocks keep their prefix hash until they are reused,
    so a later request with the same prefix can take them back (least recently freed are reused first)."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"num_blocks {num_blocks} is too small: block 0 is reserved, at least 2 are needed")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}            # prefix hash -> block id
        # ordered set of free block ids; the head is reused first
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (evicting their cached prefix, if any). The caller checks `num_free_blocks` first."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.block_hash[block] = None
            self.ref_cnt[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, h: int) -> int | None:
        return self.cached.get(h) if self.enable_prefix_caching else None

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by `lookup`."""
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def cache(self, block: int, h: int) -> None:
        """Record that `block` now holds the full block whose chained hash is `h`."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        self.block_hash[block] = h
        self.cached.setdefault(h, block)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; blocks reaching zero become free (last block first, so a request's
        tail is evicted before its shared prefix)."""
        for b in reversed(blocks):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            if self.ref_cnt[b] == 0:
                self.block_hash[b] = None
                del self.cached[h]


class KVCacheManager:
    """Block tables of one KV-cache group: which blocks each request holds, and its prefix hashes."""

    def __init__(self, group: KVCacheGroup, num_blocks: int, enable_prefix_caching: bool):
        self.group = group
        self.block_size = group.spec.block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}
        self.req_num_published: dict[str, int] = {}   # full blocks already handed to the pool's prefix map

    def _hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's full blocks among its first `num_tokens` tokens (memoised)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        if len(hashes) < num_tokens // bs:
            tokens = request.all_token_ids
            while len(hashes) < num_tokens // bs:
                i = len(hashes)
                hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes[:num_tokens // bs]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the longest cached prefix of the request. At least one token is always left
        to compute, since the step must produce logits for the last one."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = self._hashes(request, request.num_tokens - 1)
        blocks = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def blocks_needed(self, request: Request, num_total_tokens: int, num_cached_blocks: int = 0) -> int:
        held = len(self.req_blocks.get(request.request_id, ())) + num_cached_blocks
        return max(0, -(-num_total_tokens // self.block_size) - held)

    def allocate(self, request: Request, num_total_tokens: int, cached_blocks: Sequence[int] = ()) -> None:
        """Give the request blocks for its first `num_total_tokens` tokens (the caller checked there are enough)."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if cached_blocks:
            self.pool.touch(cached_blocks)
            blocks.extend(cached_blocks)
        blocks.extend(self.pool.allocate(self.blocks_needed(request, num_total_tokens)))

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's blocks that are full after this step, so other requests can reuse them."""
        rid = request.request_id
        done = self.req_num_published.get(rid, 0)
        if not self.pool.enable_prefix_caching or num_computed_tokens // self.block_size <= done:
            return
        blocks = self.req_blocks[rid]
        hashes = self._hashes(request, num_computed_tokens)
        for i in range(done, len(hashes)):
            self.pool.cache(blocks[i], hashes[i])
        self.req_num_published[rid] = len(hashes)

    def free(self, request: Request) -> None:
        self.pool.release(self.req_blocks.pop(request.request_id, []))
        self.req_hashes.pop(request.request_id, None)
        self.req_num_published.pop(request.request_id, None)


class KVCacheCoordinator:
    """One `KVCacheManager` per KV-cache group, allocating for all groups or for none."""

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int, enable_prefix_caching: bool):
        if not groups:
            raise ValueError("a model needs at least one KV-cache group")
        self.managers = [KVCacheManager(g, num_blocks, enable_prefix_caching) for g in groups]
        self.num_blocks = num_blocks
        self.block_size = groups[0].spec.block_size

    def find_cached_prefix(self, request: Request) -> list[list[int]]:
        """Per group, the cached prefix blocks; trimmed to the length every group has."""
        found = [m.find_cached_prefix(request) for m in self.managers]
        n = min(len(f) for f in found)
        return [f[:n] for f in found]

    def try_allocate(self, request: Request, num_total_tokens: int,
                     cached_blocks: Sequence[Sequence[int]] | None = None) -> bool:
        """Allocate in every group, or in none if any group lacks free blocks."""
        if not cached_blocks:
            rid = request.request_id
            if all(len(m.req_blocks.get(rid, ())) * self.block_size >= num_total_tokens for m in self.managers):
                return True     # the common decode step: the last block still has room
        cached_blocks = cached_blocks or [()] * len(self.managers)
        for m, cached in zip(self.managers, cached_blocks):
            # cached blocks that sit in the free list are taken out of it by touch(), so count them as used
            reclaimed = sum(1 for b in cached if m.pool.ref_cnt[b] == 0)
            if m.blocks_needed(request, num_total_tokens, len(cached)) + reclaimed > m.pool.num_free_blocks:
                return False
        for m, cached in zip(self.managers, cached_blocks):
            m.allocate(request, num_total_tokens, cached)
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.cache_full_blocks(request, num_computed_tokens)

    def block_ids(self, request: Request) -> tuple[list[int], ...]:
        """Per group, the request's live block list (not a copy: read it within the step)."""
        return tuple(m.req_blocks.get(request.request_id, []) for m in self.managers)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)

    @property
    def num_free_blocks(self) -> int:
        return min(m.pool.num_free_blocks for m in self.managers)
