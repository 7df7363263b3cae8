"""KV-cache groups: equal-size groups over one shared block pool, sliding-window groups that free what slid out,
all-or-nothing allocation, prefix hits that leave every group what it reads, and the capacity gain."""

import pytest
import torch

from ember.config import SchedulerConfig
from ember.engine.kv_manager import NULL_BLOCK, KVCacheCoordinator
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler
from ember.kv_spec import KVCacheGroup, KVCacheSpec, blocks_per_request
from ember.models.layers.attention import Attention
from ember.runner.kv_cache_setup import AttentionSetup, allocate_kv_caches, group_layers
from ember.sampling_params import SamplingParams

BS, W = 4, 8
FULL = KVCacheSpec(BS, 2, 8, torch.float32)
LOCAL = KVCacheSpec(BS, 2, 8, torch.float32, sliding_window=W)


def make(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def attention_layers(windows, sharing=None):
    """Attention layers named l0, l1, ... with the given windows (None: global) and KV-sharing targets."""
    sharing = sharing or {}
    return {f"l{i}": Attention(f"l{i}", 4, 2, 8, 8 ** -0.5, sliding_window=w, kv_sharing_target=sharing.get(i))
            for i, w in enumerate(windows)}


def test_groups_have_equal_size_and_follow_layer_order():
    windows = ([W] * 5 + [None]) * 4 + [W, W]        # Gemma 3 1B: 22 local and 4 global layers
    groups = group_layers(attention_layers(windows), BS, torch.float32)
    kinds = [(g.spec.sliding_window, len(g.layer_names)) for g in groups]
    assert kinds == [(W, 4), (W, 4), (None, 4), (W, 4), (W, 4), (W, 4), (W, 2)]
    assert groups[1].layer_names == ("l4", "l6", "l7", "l8") and groups[2].layer_names == ("l5", "l11", "l17", "l23")
    assert sorted(n for g in groups for n in g.layer_names) == sorted(f"l{i}" for i in range(26))
    # a model of one kind keeps one group of every layer, as before
    assert [len(g.layer_names) for g in group_layers(attention_layers([None] * 3), BS, torch.float32)] == [3]


def test_kv_sharing_layers_join_their_owners_group_and_own_no_slot():
    layers = attention_layers([W, None, W, None], sharing={2: "l0", 3: "l1"})
    groups = group_layers(layers, BS, torch.float32)
    assert [(g.layer_names, g.kv_sharing) for g in groups] == [
        (("l0", "l2"), (("l2", "l0"),)), (("l1", "l3"), (("l3", "l1"),))]
    from ember.attention_backends.torch_ref import TorchRefBackend
    setup = AttentionSetup(layers, groups, [TorchRefBackend] * 2, [{}, {}])
    assert setup.slots_per_block == 1 and setup.num_cache_layers == 2
    states = allocate_kv_caches(setup, 5, torch.device("cpu"))
    assert states["l2"].kv_cache is states["l0"].kv_cache and states["l2"].group_index == 0
    # both groups' first layers use slot 0: one block id means the same memory whichever group holds it
    assert states["l1"].kv_cache.data_ptr() == states["l0"].kv_cache.data_ptr()
    assert tuple(states["l0"].kv_cache.shape) == (2, 5, BS, 2, 8)
    with pytest.raises(ValueError, match="cycle"):
        group_layers(attention_layers([None] * 3, sharing={1: "l2", 2: "l1"}), BS, torch.float32)


def test_sliding_group_frees_blocks_that_slide_out():
    kv = KVCacheCoordinator([KVCacheGroup(("g",), FULL), KVCacheGroup(("l",), LOCAL)], 64, False)
    req = make("a", 6)
    assert kv.try_allocate(req, 6)
    req.num_computed_tokens = 6
    for n in range(7, 41):           # decode to 40 tokens, one token per step
        assert kv.try_allocate(req, n)
        req.num_computed_tokens = n
    full, local = kv.block_ids(req)
    assert len(full) == len(local) == 10 and NULL_BLOCK not in full
    live = [b for b in local if b != NULL_BLOCK]
    # the last step's query (position 39) sees keys 32..39: blocks 8 and 9; everything before is back in the pool
    assert local[:8] == [NULL_BLOCK] * 8 and len(live) == 2 <= LOCAL.max_blocks_held(40)
    assert kv.num_free_blocks == 63 - 10 - 2
    kv.free(req)
    assert kv.num_free_blocks == 63


def test_decode_calls_the_allocator_only_for_a_new_block_and_releases_there(monkeypatch):
    """A decode step whose blocks have room makes no allocator call, sliding window or not; the window's release
    happens at the next call, which leaves the request what one-token steps need."""
    kv = KVCacheCoordinator([KVCacheGroup(("g",), FULL), KVCacheGroup(("l",), LOCAL)], 64, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=64)
    calls = []
    real = kv.try_allocate
    monkeypatch.setattr(kv, "try_allocate", lambda req, n, cached=None: calls.append(n) or real(req, n, cached))
    req = make("a", 6)
    sched.add_request(req)
    for _ in range(31):                  # the prompt, then 30 decode steps: tokens up to 36
        out = sched.schedule()
        sched.update(out, [7] * len(out.scheduled))
    assert req.num_computed_tokens == 36
    assert calls == [6] + [n for n in range(7, 37) if n % BS == 1], calls     # 9, 13, ..., 33
    live = [b for b in kv.block_ids(req)[1] if b != NULL_BLOCK]
    # last call at 33 tokens: query 32 sees keys 25..32, blocks 6..8
    assert len(live) == 3 <= LOCAL.max_blocks_held(33)
    assert kv.block_ids(req)[1][:6] == [NULL_BLOCK] * 6


def test_allocation_is_all_or_nothing_across_groups():
    kv = KVCacheCoordinator([KVCacheGroup(("g",), FULL), KVCacheGroup(("l",), LOCAL)], 8, False)   # 7 usable
    a = make("a", 12)
    assert kv.try_allocate(a, 12)                      # 3 + 3 blocks
    b = make("b", 4, start=100)
    assert not kv.try_allocate(b, 4)                   # 1 + 1 > 1 free
    assert kv.block_ids(b) == ([], []) and kv.num_free_blocks == 1


def test_preemption_and_finishing_free_every_group():
    groups = [KVCacheGroup(("g",), FULL), KVCacheGroup(("l",), LOCAL)]
    kv = KVCacheCoordinator(groups, 13, False)         # 12 usable
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, max_model_len=40)
    reqs = [make("a", 9), make("b", 9, start=20), make("c", 9, start=40)]
    for r in reqs:
        sched.add_request(r)
    largest_chunk: dict[str, int] = {}
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        for s in out.scheduled:
            # windows release at the request's next allocator call: until then it may hold what its largest chunk
            # (a prefill) needed, never more
            rid = s.request.request_id
            largest_chunk[rid] = max(largest_chunk.get(rid, 0), s.num_new_tokens)
            held = sum(b != NULL_BLOCK for b in kv.block_ids(s.request)[1])
            assert held <= LOCAL.max_blocks_held(s.num_computed_tokens + s.num_new_tokens, largest_chunk[rid])
        for req, _ in sched.update(out, [7] * len(out.scheduled)):
            if len(req.output_token_ids) >= 12:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    assert not sched.has_unfinished() and sched.stats.num_preemptions >= 1
    assert all(r.output_token_ids == [7] * 12 for r in reqs)
    assert kv.num_free_blocks == 12


def test_prefix_hit_gives_sliding_groups_only_their_window():
    kv = KVCacheCoordinator([KVCacheGroup(("g",), FULL), KVCacheGroup(("l",), LOCAL)], 64, True)
    a = make("a", 30)
    assert kv.try_allocate(a, 30)
    kv.cache_full_blocks(a, 30)                        # 7 full blocks in each group
    kv.free(a)                                         # freed blocks keep their hashes
    b = make("b", 30)
    full, local = kv.find_cached_prefix(b)
    # 7 blocks = 28 tokens; the query at 28 reads keys 21..28, i.e. blocks 5 and 6 of the local group
    assert len(full) == len(local) == 7 and NULL_BLOCK not in full
    assert local[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in local[5:]
    assert kv.try_allocate(b, 30, [full, local])
    assert kv.num_free_blocks == 63 - 8 - 3


def test_prefix_hit_shrinks_when_a_window_block_was_evicted():
    kv = KVCacheCoordinator([KVCacheGroup(("g",), FULL), KVCacheGroup(("l",), LOCAL)], 64, True)
    a = make("a", 30)
    assert kv.try_allocate(a, 30)
    kv.cache_full_blocks(a, 30)
    local_block_6 = kv.block_ids(a)[1][6]
    kv.free(a)
    # evict the local group's block 6 only (as if reused by another request)
    kv.pool.cached.pop(kv.pool.block_hash[local_block_6])
    kv.pool.block_hash[local_block_6] = None
    full, local = kv.find_cached_prefix(make("b", 30))
    # a 6-block hit needs local blocks 4 and 5 (keys 17..24): still cached
    assert len(full) == len(local) == 6 and local[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in local[4:]


def test_gemma3_shaped_pool_holds_three_times_the_tokens():
    """5 local : 1 global, window 512: at 8k-token requests the same pool serves >= 3x the tokens."""
    windows = ([512] * 5 + [None]) * 4
    groups = group_layers(attention_layers(windows), 16, torch.bfloat16)
    all_global = group_layers(attention_layers([None] * len(windows)), 16, torch.bfloat16)
    usable = 10_000                                    # block ids of 4 layers' pages each (the group size)
    per_hybrid = blocks_per_request(groups, 8192)
    # the same bytes as all-global blocks of 24 layers' pages
    per_global = blocks_per_request(all_global, 8192) * 24 / 4
    assert usable // per_hybrid >= 3 * (usable // per_global)
    # and through the coordinator: admit 8k-token requests until the pool is full
    kv = KVCacheCoordinator(groups, usable + 1, False)
    admitted = 0
    while True:
        req = make(str(admitted), 8192)
        if not kv.try_allocate(req, 512):              # chunked prefill, 512 tokens per step
            break
        req.num_computed_tokens = 512
        while req.num_computed_tokens < 8192 and kv.try_allocate(req, req.num_computed_tokens + 512):
            req.num_computed_tokens += 512
        if req.num_computed_tokens < 8192:
            break
        admitted += 1
    assert admitted * 8192 >= 3 * usable * 4 * 16 // 24


def test_a_group_no_backend_can_serve_names_its_layers(monkeypatch):
    from torch import nn

    from ember.attention_backends.registry import BackendSelectionError
    from ember.runner.kv_cache_setup import select_backends

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = nn.ModuleList(attention_layers([W, None, W]).values())
    with pytest.raises(BackendSelectionError, match=r"layers l0 \(sliding_window 8\): attention backend "
                                                    r"'triton_unified' cannot serve .*TRITON_INTERPRET"):
        select_backends(model, BS, torch.float32, torch.device("cpu"), "triton_unified")
