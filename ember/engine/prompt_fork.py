"""Parallel sampling on the scheduler's side: the n samples of one prompt share its full prompt blocks.

The first sample (the leader) is scheduled like any request and computes the whole prompt. The others wait in the
queue behind it until the leader's full prompt blocks are computed by a launched step; then the fork takes one
reference on those blocks and every other sample starts from them, computing only its tail: the tokens of the last,
partial block (1 to block_size tokens; a prompt of whole blocks recomputes its last block, because the last
prompt token's logits must come from a step). Recomputing a tail of less than a block costs about as much as
copying a block, and needs no copy-on-write machinery in the runner: no block is ever written by two requests.

The sharing goes through reference counts, not the prefix-cache map, so it works with prefix caching off. The
fork's own reference keeps the blocks alive while any sample is unfinished, even after the leader finished
(max_tokens=1) or was preempted, and a preempted sample resumes from them too.
"""

from __future__ import annotations

from typing import Sequence

from ember.engine.kv_manager import KVCacheCoordinator
from ember.engine.request import Request, RequestStatus


class PromptFork:
    """The prompt blocks shared by the samples of one request with n > 1: `num_shared_tokens` tokens (whole
    blocks) computed by `leader`, with one reference of its own while any sample is unfinished."""

    def __init__(self, leader: Request, num_shared_tokens: int, num_samples: int):
        self.leader = leader
        self.num_shared_tokens = num_shared_tokens
        self.num_unfinished = num_samples
        self.blocks: list[list[int]] | None = None   # per KV-cache group, once taken
        self.readable_from_step = 0                 # the first step that may read them (they are written before)
        # the leader ended without leaving the blocks, or a sliding window dropped one: each sample computes its
        # own prompt (the prefix cache may still help)
        self.unshared = False

    def admission_prefix(self, req: Request, kv: KVCacheCoordinator, step_index: int,
                         scheduled: Sequence) -> list[list[int]] | None:
        """The blocks `req` (a sample) starts from, per KV-cache group, when it is admitted in step `step_index`;
        None when it must wait for the leader. `scheduled` holds this step's `ScheduledRequest`s so far."""
        if self.blocks is None and not self.unshared:
            if req is self.leader:
                return kv.find_cached_prefix(req)
            leader = self.leader
            if leader.status is not RequestStatus.RUNNING or leader.num_computed_tokens < self.num_shared_tokens:
                return None
            # computed by an earlier step, or only by this one (then readable from the next step on)
            start = next((s.num_computed_tokens for s in scheduled if s.request is leader),
                         leader.num_computed_tokens)
            self._take(kv, step_index if start >= self.num_shared_tokens else step_index + 1)
        cached = kv.find_cached_prefix(req)
        if self.blocks is None:
            return cached
        if step_index < self.readable_from_step:
            return None
        # a preempted sample may find more of its own tokens in the prefix cache
        return self.blocks if len(self.blocks[0]) > len(cached[0]) else cached

    def on_finish(self, req: Request, status: RequestStatus, kv: KVCacheCoordinator, step_index: int) -> None:
        """A sample finished or was aborted (before its blocks are freed): the leader leaves its computed prompt
        blocks to the others, and the last sample drops the fork's reference."""
        if req is self.leader and self.blocks is None and not self.unshared:
            if status is not RequestStatus.FINISHED_ABORTED and req.num_computed_tokens >= self.num_shared_tokens:
                self._take(kv, step_index)     # written by steps launched before the next one
            else:
                self.unshared = True
        self.num_unfinished -= 1
        if self.num_unfinished == 0 and self.blocks is not None:
            kv.release_shared(self.blocks)
            self.blocks = None
            self.unshared = True

    def _take(self, kv: KVCacheCoordinator, readable_from_step: int) -> None:
        self.blocks = kv.share_prefix(self.leader, self.num_shared_tokens)
        self.readable_from_step = readable_from_step
        if self.blocks is None:
            self.unshared = True
