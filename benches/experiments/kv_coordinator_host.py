"""Host time of the KV-cache coordinator in steady decode, by KV-group layout: the allocator and prefix-publishing
calls a scheduler makes for N running requests, gated as `Scheduler.schedule` and `update` gate them (a request
reaches the coordinator only when it needs a block or fills one), with no model.

    PYTHONPATH=. python benches/experiments/kv_coordinator_host.py --requests 256 --steps 256

Layouts: one full-attention group; one sliding-window group; a Gemma-3-shaped 6 sliding (window 512) + 1 global.
"""

from __future__ import annotations

import argparse
import time

import torch

from ember.engine.kv_manager import KVCacheCoordinator
from ember.engine.request import Request
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from ember.sampling_params import SamplingParams

BLOCK_SIZE = 16


def layout(num_sliding: int, num_full: int, window: int = 512) -> list[KVCacheGroup]:
    spec = dict(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=256, dtype=torch.bfloat16)
    return ([KVCacheGroup((f"local{i}",), KVCacheSpec(**spec, sliding_window=window)) for i in range(num_sliding)]
            + [KVCacheGroup((f"global{i}",), KVCacheSpec(**spec)) for i in range(num_full)])


def ms_per_step(groups: list[KVCacheGroup], num_requests: int, steps: int, prompt_len: int) -> float:
    kv = KVCacheCoordinator(groups, 2 * len(groups) * num_requests * (prompt_len + steps) // BLOCK_SIZE, True)
    requests = [Request(f"r{i}", [(i * 7 + j) % 30_000 for j in range(prompt_len)], SamplingParams())
                for i in range(num_requests)]
    for r in requests:
        assert kv.try_allocate(r, prompt_len)
        kv.cache_full_blocks(r, prompt_len)
        r.num_computed_tokens = prompt_len
    capacity, published = kv.req_capacity, kv.req_num_published
    start = time.perf_counter()
    for step in range(steps):
        for r in requests:
            computed = r.num_computed_tokens
            if computed + 1 > capacity[r.request_id]:
                assert kv.try_allocate(r, computed + 1)
                kv.block_ids(r)
            if (computed + 1) // BLOCK_SIZE > published[r.request_id]:
                kv.cache_full_blocks(r, computed + 1)
            r.num_computed_tokens = computed + 1
            r.output_token_ids.append(step)
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--repeats", type=int, default=5, help="runs per layout after the first; best and median shown")
    args = p.parse_args()
    for name, groups in (("1 full-attention group", layout(0, 1)), ("1 sliding-window group", layout(1, 0)),
                         ("6 sliding + 1 full (Gemma-3-shaped)", layout(6, 1))):
        first = ms_per_step(groups, args.requests, args.steps, args.prompt_len)    # the interpreter warms up too
        runs = sorted(ms_per_step(groups, args.requests, args.steps, args.prompt_len) for _ in range(args.repeats))
        best, median = runs[0], runs[len(runs) // 2]
        print(f"{name:38s} {best:.3f} ms/step best, {median:.3f} median, for {args.requests} decodes "
              f"({1e3 * best / args.requests:.2f} us each; first run {first:.3f})")


if __name__ == "__main__":
    main()
