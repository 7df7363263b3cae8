"""Block pool, prefix hashing and the scheduler's budget, chunking and preemption, without a model."""

import random

import pytest
import torch

from ember.config import SchedulerConfig
from ember.engine.kv_manager import NULL_BLOCK, BlockPool, KVCacheCoordinator
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from ember.sampling_params import SamplingParams
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler

BS = 4
GROUPS = [KVCacheGroup(("a", "b"), KVCacheSpec(BS, 2, 8, torch.float32)),
          KVCacheGroup(("c",), KVCacheSpec(BS, 2, 8, torch.float32, sliding_window=8))]


def make(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def test_page_size_counts_k_and_v():
    assert KVCacheSpec(16, 8, 128, torch.bfloat16).page_size_bytes == 2 * 16 * 8 * 128 * 2


def test_pool_never_hands_out_the_null_block_and_recycles():
    pool = BlockPool(5, enable_prefix_caching=False)
    got = pool.allocate(4)
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3, 4] and pool.num_free_blocks == 0
    pool.release(got)
    assert pool.num_free_blocks == 4 and all(pool.ref_cnt[b] == 0 for b in got)


def test_prefix_hits_share_blocks_across_groups_and_keep_one_token_to_compute():
    kv = KVCacheCoordinator(GROUPS, num_blocks=32, enable_prefix_caching=True)
    a = make("a", 10)
    assert kv.try_allocate(a, 10)
    kv.cache_full_blocks(a, 10)                   # 2 full blocks of 4
    b = make("b", 10)                             # same 10 tokens
    cached = kv.find_cached_prefix(b)
    assert [len(c) for c in cached] == [2, 2]
    assert cached[0] == kv.block_ids(a)[0][:2]
    c = make("c", 8)                              # exactly 2 blocks: the last token must be recomputed
    assert [len(x) for x in kv.find_cached_prefix(c)] == [1, 1]
    d = make("d", 10, start=1)                    # different first block: no hit, chained hashes
    assert [len(x) for x in kv.find_cached_prefix(d)] == [0, 0]
    assert kv.try_allocate(b, 10, cached)
    assert kv.managers[0].pool.ref_cnt[cached[0][0]] == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 31
    # freed blocks keep their hash until reused
    assert [len(x) for x in kv.find_cached_prefix(make("e", 10))] == [2, 2]


def test_prefix_hashes_grown_chunk_by_chunk_equal_those_taken_at_once():
    kv = KVCacheCoordinator(GROUPS, num_blocks=64, enable_prefix_caching=True)
    a = make("a", 30)
    assert kv.try_allocate(a, 30)
    for end in (5, 13, 21, 30):                   # a chunked prefill publishes its blocks piece by piece
        kv.cache_full_blocks(a, end)
    at_once = KVCacheCoordinator(GROUPS, num_blocks=64, enable_prefix_caching=True)._hashes(make("x", 30), 30)
    assert kv._hashes(a, 30) == at_once and len(at_once) == 7
    b = Request("b", list(range(4)) + [99] + list(range(5, 30)), SamplingParams(max_tokens=100))
    assert [len(x) for x in kv.find_cached_prefix(b)] == [1, 1]       # only the block before the change
    assert [len(x) for x in kv.find_cached_prefix(make("c", 30))] == [7, 7]


def test_all_or_nothing_allocation():
    kv = KVCacheCoordinator(GROUPS, num_blocks=4, enable_prefix_caching=False)   # 3 usable blocks
    assert not kv.try_allocate(make("a", 13), 13)                                 # needs 4
    assert kv.num_free_blocks == 3 and kv.block_ids(make("a", 13)) == ([], [])



def test_prefix_hit_in_the_free_list_is_not_handed_out_as_a_fresh_block():
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=5, enable_prefix_caching=True)   # blocks 1..4
    a, c = make("a", 8), make("c", 8, start=50)
    assert kv.try_allocate(a, 8) and kv.try_allocate(c, 8)
    kv.cache_full_blocks(a, 8)
    assert kv.block_ids(a)[0] == [1, 2] and kv.block_ids(c)[0] == [3, 4]
    kv.free(a)                                   # tail first: the free list is 2, 1
    kv.free(c)                                   # then 4, 3
    assert list(kv.pool.free) == [2, 1, 4, 3]
    b = make("b", 9)                             # a's 8 tokens and one more: hits 1 and 2, one fresh block
    cached = kv.find_cached_prefix(b)
    assert cached == [[1, 2]]
    assert kv.try_allocate(b, 9, cached)
    # block 2 heads the free list, but it is one of the hits: the fresh block is the next free one, 4
    assert kv.block_ids(b)[0] == [1, 2, 4]
    assert [kv.pool.ref_cnt[x] for x in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert list(kv.pool.free) == [3]


def run_steps(sched, steps=100):
    """Drive the scheduler as the engine would: each sampling request gets token 7."""
    trace = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        trace.append(out)
        for req, _ in sched.update(out, [7] * len(out.scheduled)):
            if len(req.output_token_ids) >= 3:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    return trace


def test_token_budget_chunks_prefill_and_puts_decodes_first():
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=64, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=6), kv, max_model_len=64)
    sched.add_request(make("a", 3))
    sched.add_request(make("b", 9, start=50))
    trace = run_steps(sched)
    assert all(o.total_num_tokens <= 6 for o in trace)
    first = trace[0]
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("a", 3), ("b", 3)]
    second = trace[1]
    assert second.num_decodes == 1 and second.scheduled[0].request.request_id == "a"
    assert [s.num_new_tokens for s in second.scheduled] == [1, 5]
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == 63


def test_preemption_requeues_the_newest_and_loses_nothing():
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=5, enable_prefix_caching=False)   # 4 blocks = 16 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len=16)
    reqs = [make("a", 7), make("b", 7, start=20)]
    for r in reqs:
        sched.add_request(r)
    trace = run_steps(sched)
    assert sched.stats.num_preemptions >= 1
    assert any("b" in o.preempted_ids for o in trace)
    assert all(r.output_token_ids == [7, 7, 7] for r in reqs)
    assert kv.num_free_blocks == 4



def run_with_cache_contents(seed: int, enable_prefix_caching: bool) -> tuple[dict[str, list[int]], Scheduler]:
    """Drive the scheduler over a small pool with prompts that share prefixes, keeping what each block slot holds
    (position, token) as the steps write it; every step checks that each request's block list reads back exactly its
    own tokens at their positions, as attention would. A sampled token is a function of all the tokens before it."""
    rng = random.Random(seed)
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=9, enable_prefix_caching=enable_prefix_caching)  # 32 tokens
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16), kv, max_model_len=32)
    prefixes = [[rng.randrange(100) for _ in range(12)] for _ in range(2)]
    for i in range(6):
        prompt = rng.choice(prefixes)[:rng.randrange(1, 13)] + [rng.randrange(100) for _ in range(rng.randrange(3))]
        req = Request(str(i), prompt, SamplingParams())
        req.max_tokens = rng.randrange(4, 32 - len(prompt))
        sched.add_request(req)
    reqs = list(sched.requests.values())
    slots: dict[tuple[int, int], tuple[int, int]] = {}
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for s in out.scheduled:
            blocks = kv.block_ids(s.request)[0]
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                slots[blocks[pos // BS], pos % BS] = (pos, s.request.token_at(pos))
        sampled = []
        for s in out.scheduled:
            req, end, blocks = s.request, s.num_computed_tokens + s.num_new_tokens, kv.block_ids(s.request)[0]
            assert len(set(blocks)) == len(blocks), (seed, req.request_id, blocks)
            assert [slots.get((blocks[p // BS], p % BS)) for p in range(end)] == \
                [(p, req.token_at(p)) for p in range(end)], (seed, req.request_id)
            sampled.append(sum((p + 1) * req.token_at(p) for p in range(end)) % 97)
        for req, _ in sched.update(out, sampled):
            if len(req.output_token_ids) >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished() and kv.num_free_blocks == 8
    return {r.request_id: r.output_token_ids for r in reqs}, sched


def test_preempted_requests_read_back_their_own_tokens_with_prefix_caching():
    hits = preemptions = 0
    for seed in range(12):
        on, sched = run_with_cache_contents(seed, enable_prefix_caching=True)
        off, _ = run_with_cache_contents(seed, enable_prefix_caching=False)
        assert on == off, seed
        hits += sched.stats.num_prefix_cache_hits
        preemptions += sched.stats.num_preemptions
    assert hits > 0 and preemptions > 0


def test_max_num_seqs_bounds_running():
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=64, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, max_model_len=64)
    for i in range(5):
        sched.add_request(make(str(i), 3, start=10 * i))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3


def test_abort_frees_blocks():
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=16, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64)
    sched.add_request(make("a", 9))
    sched.schedule()
    assert kv.num_free_blocks == 15 - 3
    assert sched.abort("a") and not sched.abort("a")
    assert kv.num_free_blocks == 15 and not sched.has_unfinished()


def test_duplicate_request_id_is_refused():
    kv = KVCacheCoordinator(GROUPS[:1], num_blocks=16, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64)
    sched.add_request(make("a", 3))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add_request(make("a", 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_cache_memory_comes_zeroed_and_aligned(dtype):
    from ember.runner.kv_cache_setup import zeroed
    t = zeroed(4099, dtype, torch.device("cpu"))
    assert t.shape == (4099,) and t.dtype == dtype and t.data_ptr() % 64 == 0
    assert not t.float().any()
    t[4098] = 3
    assert t[4098].item() == 3 and t.float().sum().item() == 3
