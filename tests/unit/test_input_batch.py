"""The persistent input batch: whatever the order of requests between steps (rows reused, requests moving rows,
blocks growing), the tensors equal a from-scratch computation."""

import random

import numpy as np
import torch

from ember.runner.input_batch import InputBatch
from ember.sampling_params import SamplingParams
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledRequest, SchedulerOutput

BS = 4


def expected(scheduled):
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for s in scheduled:
        toks = s.request.all_token_ids
        for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
            ids.append(toks[p])
            pos.append(p)
            slots.append(s.block_ids[0][p // BS] * BS + p % BS)
        qsl.append(qsl[-1] + s.num_new_tokens)
        lens.append(s.num_computed_tokens + s.num_new_tokens)
    return ids, pos, slots, qsl, lens


def test_rows_follow_requests_across_steps():
    rng = random.Random(0)
    batch = InputBatch(num_groups=1, block_size=BS, max_num_reqs=8, max_num_tokens=64, max_model_len=64,
                       device=torch.device("cpu"))
    next_block = iter(range(1, 10_000))
    reqs = {}
    for i in range(6):
        r = Request(str(i), [rng.randrange(100) for _ in range(rng.randint(1, 9))], SamplingParams())
        r.output_token_ids = [rng.randrange(100) for _ in range(rng.randint(0, 20))]
        reqs[r.request_id] = (r, [next(next_block) for _ in range(-(-(r.num_tokens + 1) // BS))])
    for step in range(12):
        chosen = rng.sample(sorted(reqs), rng.randint(1, 6))
        scheduled = []
        for rid in chosen:
            r, blocks = reqs[rid]
            if rng.random() < 0.3:           # grow: the request gains a block, keeping the same list object
                blocks.append(next(next_block))
            decode = rng.random() < 0.6
            n = 1 if decode else rng.randint(2, 5)
            start = max(0, r.num_tokens - n) if decode else rng.randint(0, max(0, r.num_tokens - n))
            n = min(n, r.num_tokens - start)
            scheduled.append(ScheduledRequest(r, start, n, (blocks,)))
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        num_decodes = sum(s.num_new_tokens == 1 for s in scheduled)
        out = SchedulerOutput(tuple(scheduled), num_decodes)
        t = out.total_num_tokens
        pb = batch.prepare(out, t + 3, len(scheduled) + 1)
        ids, pos, slots, qsl, lens = expected(scheduled)
        c = pb.common
        assert pb.input_ids[:t].tolist() == ids and pb.positions[:t].tolist() == pos, step
        assert c.slot_mappings[0][:t].tolist() == slots and c.slot_mappings[0][t:].tolist() == [-1] * 3
        assert c.query_start_loc.tolist() == qsl + [t] and c.seq_lens.tolist() == lens + [0]
        for row, s in enumerate(scheduled):
            blocks = s.block_ids[0]
            assert c.block_tables[0][row, :len(blocks)].tolist() == blocks, (step, row)
        assert pb.logits_indices.tolist() == list(np.cumsum([s.num_new_tokens for s in scheduled]) - 1)
        assert c.num_decodes == num_decodes and c.max_query_len == max(s.num_new_tokens for s in scheduled)
