"""The runner's request table under random sequences of arrival, finish, abort and preemption, driven by the real
scheduler through `StepInput` only, with a step in flight as in async scheduling: every row holds its request's
tokens, blocks, sampling parameters and computed count, and no row or block leaks."""

import random

import numpy as np
import pytest
import torch

from ember.config import SchedulerConfig
from ember.engine.kv_manager import KVCacheCoordinator
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler
from ember.kv_spec import KVCacheGroup, KVCacheSpec
from ember.runner.request_table import NUM_PROMPT, SEED, TEMPERATURE, RequestTable
from ember.runner.step_input import StepInput
from ember.runner.upload import PackedUpload
from ember.sampling_params import SamplingParams

BS, VOCAB, MAX_LEN, MAX_SEQS = 4, 50, 48, 6
CPU = torch.device("cpu")


class _Harness:
    """The scheduler, a KV manager and the runner's table, joined the way the engine and runner join them."""

    def __init__(self, rng: random.Random, num_blocks: int, budget: int):
        spec = KVCacheSpec(BS, 1, 8, torch.float32)
        self.kv = KVCacheCoordinator([KVCacheGroup(("l0",), spec)], num_blocks, enable_prefix_caching=True)
        config = SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=budget)
        self.scheduler = Scheduler(config, self.kv, MAX_LEN)
        self.table = RequestTable(1, BS, MAX_SEQS, MAX_LEN, VOCAB, CPU)
        self.upload = PackedUpload(64, CPU)
        self.rng = rng
        self.in_flight = None
        self.next_id = 0
        self.num_preemptions_seen = 0

    def add(self) -> None:
        rng = self.rng
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        # a shared prefix now and then, so prefix-cache hits start some rows part-way
        if rng.random() < 0.3:
            prompt = [7] * 8 + prompt
        params = SamplingParams(temperature=rng.choice([0.0, 0.7]), max_tokens=rng.randint(1, 12), ignore_eos=True)
        req = Request(f"r{self.next_id}", prompt, params, sampling_seed=self.next_id,
                      max_tokens=min(params.max_tokens, MAX_LEN - len(prompt)))
        self.next_id += 1
        self.scheduler.add_request(req)

    def step(self) -> None:
        """Schedule, apply to the table, 'sample' into the table, then resolve the previous step (async)."""
        out = self.scheduler.schedule()
        step = out.step
        self.upload.begin()
        self.table.apply(step, self.upload)
        if not step.is_empty:
            rows = self.table.rows_of(step.req_ids)
            starts = np.array(step.num_computed_tokens)
            for s, start in zip(out.scheduled, starts):
                assert start == s.num_computed_tokens, s.request.request_id
            ends = starts + np.array(step.num_scheduled_tokens)
            seg = self.upload.put(self.table.sample_index(rows, ends))
        buf = self.upload.flush()
        self.table.commit(buf)
        self.check(out)
        sampled = None
        if not step.is_empty:
            tokens = torch.tensor([self.rng.randrange(VOCAB) for _ in rows])
            self.table.write_sampled(PackedUpload.segment(buf, seg), tokens)
            sampled = tokens.tolist()
        previous, self.in_flight = self.in_flight, (out, sampled) if sampled is not None else None
        if previous is not None:
            self.resolve(*previous)

    def resolve(self, out, sampled) -> None:
        for req, _ in self.scheduler.update(out, sampled):
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= MAX_LEN:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)

    def check(self, out) -> None:
        """Every running request's row matches it; nothing else holds a row."""
        running = {r.request_id: r for r in self.scheduler.running}
        assert set(self.table.rows) == set(running)
        assert len(self.table._free) + len(self.table.rows) == MAX_SEQS
        for rid, req in running.items():
            row = self.table.rows[rid]
            # the tokens the host knows (those sampled by a step in flight are on the device only)
            known = req.all_token_ids
            assert self.table.token_ids[row, :len(known)].tolist() == known, rid
            assert self.table.num_tokens[row] == req.num_tokens + req.num_pending, rid
            blocks = self.kv.block_ids(req)[0]
            assert self.table.num_blocks[0, row] == len(blocks)
            assert self.table.block_tables[0, row, :len(blocks)].tolist() == blocks, rid
            assert self.table.params_i[row, SEED] == req.sampling_seed
            assert self.table.params_i[row, NUM_PROMPT] == req.num_prompt_tokens
            temp = req.sampling_params.temperature
            assert self.table.params_f[row, TEMPERATURE] == pytest.approx(temp if temp > 0 else 1.0)

    def random_event(self) -> None:
        rng, sched = self.rng, self.scheduler
        ids = list(sched.requests)
        roll = rng.random()
        if roll < 0.35:
            self.add()
        elif roll < 0.45 and ids:
            sched.abort(rng.choice(ids))
        elif roll < 0.55 and sched.running:
            sched.finish(rng.choice(sched.running), RequestStatus.FINISHED_STOPPED)   # e.g. a stop string
        self.step()


@pytest.mark.parametrize("seed, num_blocks, budget", [(0, 14, 8), (1, 14, 64), (2, 20, 16), (3, 40, 16)])
def test_table_rows_follow_requests(seed, num_blocks, budget):
    rng = random.Random(seed)
    # few blocks and a small budget: preemptions and chunked prefills happen often
    h = _Harness(rng, num_blocks, budget)
    for _ in range(120):
        h.random_event()
    while h.scheduler.has_unfinished() or h.in_flight is not None:
        if not h.scheduler.has_unfinished():
            h.resolve(*h.in_flight)
            h.in_flight = None
            continue
        h.step()
    # the last finished requests leave the table with the next step's input, even an empty one
    last = h.scheduler.schedule().step
    assert last.is_empty
    h.upload.begin()
    h.table.apply(last, h.upload)
    assert h.table.rows == {} and sorted(h.table._free) == list(range(MAX_SEQS))
    assert h.kv.num_free_blocks == h.kv.num_blocks - 1
    assert h.scheduler.stats.num_steps > 80
    if num_blocks == 14:
        assert h.scheduler.stats.num_preemptions > 0     # the tight caches do exercise preemption


def test_new_request_with_a_used_id_or_a_full_table_is_refused():
    table = RequestTable(1, BS, 1, MAX_LEN, VOCAB, CPU)
    upload = PackedUpload(8, CPU)
    from ember.runner.step_input import NewRequest
    new = NewRequest("a", (1, 2), SamplingParams(), 0, ((1,),), 0)
    upload.begin()
    table.apply(StepInput(new_requests=(new,)), upload)
    with pytest.raises(ValueError, match="already has a row"):
        table.apply(StepInput(new_requests=(new,)), upload)
    with pytest.raises(ValueError, match="table is full"):
        table.apply(StepInput(new_requests=(NewRequest("b", (1,), SamplingParams(), 0, ((2,),), 0),)), upload)
    with pytest.raises(ValueError, match="no row in the table"):
        table.rows_of(["zzz"])


def _plan_for(table, upload, ids, ends):
    from ember.runner.sampling_inputs import plan_sampling
    upload.begin()
    return plan_sampling(table, table.rows_of(ids), np.asarray(ends), upload)


def test_sampling_plan_is_reused_only_while_the_same_requests_hold_the_rows():
    from ember.runner.step_input import NewRequest
    table = RequestTable(1, BS, 4, MAX_LEN, VOCAB, CPU)
    upload = PackedUpload(64, CPU)
    add = lambda rid, p, eos=(): table.apply(StepInput(new_requests=(NewRequest(rid, (1, 2), p, 0, ((1,),), 0,
                                                                                 (), eos),)), upload)
    upload.begin()
    add("a", SamplingParams(temperature=0.0))
    add("b", SamplingParams(temperature=0.7))
    first = _plan_for(table, upload, ["a", "b"], [3, 3])
    assert not first.all_greedy and not first.all_random
    assert _plan_for(table, upload, ["a", "b"], [4, 4]) is first          # the next decode step: reused
    assert _plan_for(table, upload, ["b", "a"], [4, 4]) is not first      # other rows: planned again
    table.remove("b")
    upload.begin()
    add("c", SamplingParams(temperature=0.0))                              # row of "b" reused by a greedy request
    again = _plan_for(table, upload, ["a", "c"], [5, 3])
    assert again.all_greedy
    # a min_tokens block list is planned every step: it ends once enough tokens are out
    upload.begin()
    add("d", SamplingParams(temperature=0.7, min_tokens=2), eos=(5,))
    blocked = _plan_for(table, upload, ["d"], [2])                         # no output token yet: EOS blocked
    assert blocked.blocked is not None
    assert _plan_for(table, upload, ["d"], [3]).blocked is not None       # one out: still blocked
    assert _plan_for(table, upload, ["d"], [4]).blocked is None           # two out: free


def test_step_input_refuses_counts_that_do_not_match_or_run_nothing():
    with pytest.raises(ValueError, match="at least one token, got \\(1, 0\\)"):
        StepInput(req_ids=("a", "b"), num_scheduled_tokens=(1, 0), num_computed_tokens=(0, 0))
    with pytest.raises(ValueError, match="2 request ids but 1 token counts"):
        StepInput(req_ids=("a", "b"), num_scheduled_tokens=(1,), num_computed_tokens=(0, 0))
    with pytest.raises(ValueError, match="2 request ids but 1 chunk starts"):
        StepInput(req_ids=("a", "b"), num_scheduled_tokens=(1, 1), num_computed_tokens=(0,))
    assert StepInput().is_empty
    assert StepInput(req_ids=("a",), num_scheduled_tokens=(3,), num_computed_tokens=(0,)).total_num_tokens == 3


def test_a_step_of_many_long_new_requests_is_written_in_pieces_and_the_upload_keeps_its_size():
    """Token and block writes beyond one piece go ahead in uploads of their own: every token and block id lands,
    the upload never grows past what start-up sized (the table's `upload_elements` beside the batch's data), and
    the number of extra uploads is the full pieces'."""
    from ember.runner.step_input import NewRequest
    rng = np.random.default_rng(0)
    piece, max_len, num_reqs, groups = 256, 1000, 5, 2
    table = RequestTable(groups, BS, num_reqs, max_len, VOCAB, CPU, write_piece=piece)
    upload = PackedUpload(64 + table.upload_elements(), CPU)
    sizes = [upload._ring[0][0].numel(), upload._ring[1][0].numel(), upload._device_buf.numel()]
    flushes = []
    real_flush = upload.flush
    upload.flush = lambda: flushes.append(upload._used) or real_flush()
    lens = [900, 1000, 700, 999, 901]
    prompts = [rng.integers(0, VOCAB, n) for n in lens]
    blocks = [[tuple(rng.integers(1, 10_000, -(-n // BS))) for _ in range(groups)] for n in lens]
    new = tuple(NewRequest(f"r{i}", tuple(int(t) for t in p), SamplingParams(), i, tuple(b), n - 1)
                for i, (p, b, n) in enumerate(zip(prompts, blocks, lens)))
    upload.begin()
    table.apply(StepInput(new_requests=new), upload)
    table.commit(upload.flush())
    num_tokens, num_blocks = sum(lens), groups * sum(-(-n // BS) for n in lens)
    assert len(flushes) == (num_tokens - 1) // piece + (num_blocks - 1) // piece + 1
    assert max(flushes) <= 64 + table.upload_elements()
    assert [upload._ring[0][0].numel(), upload._ring[1][0].numel(), upload._device_buf.numel()] == sizes
    for i, (p, b, n) in enumerate(zip(prompts, blocks, lens)):
        row = table.rows[f"r{i}"]
        assert table.token_ids[row, :n].tolist() == p.tolist()
        for g in range(groups):
            assert table.block_tables[g, row, :len(b[g])].tolist() == list(b[g])


@pytest.mark.parametrize("chunk", [6, 1 << 22])
def test_penalty_counts_from_the_table_equal_counting_the_tokens(chunk, monkeypatch):
    """The prompt's ids and the output's counts, read from the table a chunk of columns at a time (6 ids over 3
    rows: two columns a chunk) or at once, are the ids and counts of each request's own tokens."""
    from collections import Counter

    from ember.runner import sampling_inputs
    from ember.runner.step_input import NewRequest
    monkeypatch.setattr(sampling_inputs, "COUNT_CHUNK_ELEMENTS", chunk)
    rng = np.random.default_rng(1)
    table = RequestTable(1, BS, 4, MAX_LEN, VOCAB, CPU)
    upload = PackedUpload(64, CPU)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (9, 3, 20)]
    outputs = [rng.integers(0, VOCAB, n).tolist() for n in (5, 0, 11)]
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(frequency_penalty=0.5),
              SamplingParams(presence_penalty=0.3, repetition_penalty=0.9)]
    new = tuple(NewRequest(f"r{i}", tuple(p), sp, i, ((1,) * -(-(len(p) + len(o)) // BS),), len(p) + len(o) - 1,
                           tuple(o)) for i, (p, o, sp) in enumerate(zip(prompts, outputs, params)))
    upload.begin()
    table.apply(StepInput(new_requests=new), upload)
    ends = np.array([len(p) + len(o) for p, o in zip(prompts, outputs)])
    rows = table.rows_of([n.req_id for n in new])
    plan = sampling_inputs.plan_sampling(table, rows, ends, upload)
    table.commit(buf := upload.flush())
    meta = sampling_inputs.sampling_metadata(table, plan, torch.as_tensor(rows), torch.as_tensor(ends), buf)
    want_seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    want_counts = torch.zeros(3, VOCAB, dtype=torch.int32)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        want_seen[r, p] = True
        for token, n in Counter(o).items():
            want_counts[r, token] = n
    assert torch.equal(meta.prompt_mask, want_seen)
    assert torch.equal(meta.output_counts, want_counts)


class _Copy:
    """A stand-in for a CUDA event of a staging buffer's copy: done or still queued; counts host waits."""

    def __init__(self, done: bool):
        self.done, self.waits = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1


def test_a_deeper_upload_ring_takes_a_new_buffer_instead_of_waiting_for_a_queued_copy():
    upload = PackedUpload(8, CPU, max_depth=3)
    queued, done = _Copy(False), _Copy(True)
    upload._events = [None, queued]        # the buffer begin() takes next (index 1) still has its copy queued
    upload.begin()
    assert len(upload._ring) == 3 and upload._turn == 1 and queued.waits == 0
    assert upload._events == [None, None, queued]
    upload._events[0] = done
    upload.begin()          # the queued one, and the ring is at max_depth: the host waits
    assert len(upload._ring) == 3 and upload._turn == 2 and queued.waits == 1
    upload.begin()          # a buffer whose copy has run: the wait costs nothing
    assert upload._turn == 0 and done.waits == 1
    two = PackedUpload(8, CPU)              # the default ring of two always waits
    two._events = [None, _Copy(False)]
    two.begin()
    assert len(two._ring) == 2 and two._events[1].waits == 1
