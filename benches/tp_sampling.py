"""How tensor-parallel ranks come to the same sampled tokens, per decode step, timed three ways over N rows of a
vocabulary V split across the ranks (each holds [N, V / ranks] float32 logits, as the vocab-parallel LM head leaves
them), eagerly and inside a CUDA graph:

  A  every rank: `ember::all_gather` of the shards into [N, V] on every rank, then ember's Sampler on every rank
     (what the engine does: docs/distributed.md, "Sampling on every rank").
  B  rank 0 + broadcast: the same all-gather (NCCL has no gather to one rank, and a gather would bring rank 0 the same
     bytes an all-gather brings every rank), the Sampler on rank 0 only, then torch.distributed.broadcast of the
     [N] int64 tokens from rank 0, captured in the graph of every rank.
  C  shard-local: each rank the best of its own columns, logits / T + the sampler's counter-based Gumbel noise keyed
     by the token's global id (greedy rows: the logits), then an all-gather of (best value, global id) [N, 2] and the
     argmax over the ranks (ties: the lowest rank, so the lowest id). Exact for temperature sampling and greedy rows
     only: top-k/top-p/min-p, penalties, min_tokens and logprobs need the whole row (a grammar's bitmask could be
     read a shard at a time; it is not here).

The Sampler gets the general form the FULL decode graph records (`graph_sampling_metadata`: temperature per row,
greedy rows by mask, the grammar bitmask buffer with no row under a grammar), built directly as a SamplingMetadata
rather than gathered from a RequestTable: that gather of N rows is the same work in all three designs. On CUDA the
Sampler runs its one-pass Triton kernel and C a shard-local kernel made of the same device functions (same division,
same noise); on the CPU both run their torch paths.

Every result is checked on every rank: A's, B's and C's tokens must equal those of the torch sampler over the whole
row, which every rank draws alike (greedy and sampled rows, exactly); in a graph, after the inputs are filled anew.

    PYTHONPATH=. python benches/tp_sampling.py --ranks 2                      # 2 GPUs, N 1 8 64 256, V 128256
    PYTHONPATH=. python benches/tp_sampling.py --device cpu --ranks 2 --vocab 1000 --rows 1 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from ember.kernels import sampling as SK
from ember.kernels.interpret import interpreted
from ember.kernels.launcher import launcher
from ember.kernels.sampling import _block_argmax, _perturb, _row_key
from ember.runner.sampler.sampler import _GOLDEN, _mix64, _shift_right

ROWS = [1, 8, 64, 256]
VOCAB = 128256          # Llama-3's
CPU_VOCAB = 1000
DESIGNS = {"A": "every rank", "B": "rank 0 + broadcast", "C": "shard-local"}
GREEDY_EVERY = 4        # rows i with i % 4 == 3 are greedy: a batch of 1 samples, one of 8 holds both kinds


# ---- C's shard-local sampling --------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_splits"])
def _shard_partial_kernel(logits_ptr, stride_row, temperature_ptr, seed_ptr, counter_ptr, greedy_ptr, partial_ptr,
                          shard_cols, first_col, cols_per_split, num_splits,
                          ACCURATE_LOG: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, split) of this rank's columns: the best (score, local index), the score being the
    Sampler's one-pass score of the token's global id first_col + column. partial: [N, 2, num_splits] float32."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, shard_cols)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    row_key = _row_key(seed_ptr, counter_ptr, row)
    random_row = tl.load(greedy_ptr + row) == 0
    best_value = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = start + tl.arange(0, BLOCK)
    for offset in range(start, end, BLOCK):
        cols = offset + tl.arange(0, BLOCK)
        mask = cols < shard_cols
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if random_row:
            x = _perturb(x, first_col + cols, temperature_ptr, row_key, row, True, ACCURATE_LOG)
        x = tl.where(mask, x, float("-inf"))
        take = (x > best_value) | ((x != x) & (best_value == best_value))     # ties keep the lower index
        best_value = tl.where(take, x, best_value)
        best_index = tl.where(take, cols, best_index)
    value, index = _block_argmax(best_value, best_index)
    tl.store(partial_ptr + (2 * row) * num_splits + split, value)
    tl.store(partial_ptr + (2 * row + 1) * num_splits + split, index.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["num_splits"])
def _shard_reduce_kernel(partial_ptr, out_ptr, first_col, num_splits, BLOCK_SPLITS: tl.constexpr):
    """One program per row: out[row] = (best score, its global id as a float32: exact below 2**24)."""
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = splits < num_splits
    value = tl.load(partial_ptr + (2 * row) * num_splits + splits, mask=mask, other=float("-inf"))
    index = tl.load(partial_ptr + (2 * row + 1) * num_splits + splits, mask=mask, other=0.0).to(tl.int32, bitcast=True)
    best_value, best_index = _block_argmax(value, tl.where(mask, index, 2147483647))
    tl.store(out_ptr + 2 * row, best_value)
    tl.store(out_ptr + 2 * row + 1, (first_col + best_index).to(tl.float32))


def shard_best_triton(shard: torch.Tensor, first_col: int, temperature: torch.Tensor, seeds: torch.Tensor,
                      counters: torch.Tensor, greedy_mask: torch.Tensor) -> torch.Tensor:
    """[N, 2] float32: per row of `shard` [N, C] (global ids first_col..first_col + C - 1) the best score and its
    global id, as the Sampler's one-pass kernel scores tokens. CPU tensors run interpreted."""
    num_rows, shard_cols = shard.shape
    device = shard.device
    target = SK._num_programs_target(device)
    cols_per_split, num_splits = SK.split_plan(num_rows, shard_cols, target)
    partial = torch.empty(num_rows, 2, num_splits, dtype=torch.float32, device=device)     # [N, 2, splits]
    out = torch.empty(num_rows, 2, dtype=torch.float32, device=device)                    # [N, (score, id)]
    run = interpreted if device.type == "cpu" else launcher
    run(_shard_partial_kernel)[(num_rows, num_splits)](
        shard, shard.stride(0), temperature, seeds, counters, greedy_mask.view(torch.uint8), partial,
        shard_cols, first_col, cols_per_split, num_splits,
        ACCURATE_LOG=device.type == "cuda", BLOCK=SK.BLOCK_SIZE, num_warps=SK.NUM_WARPS)
    max_splits = SK.split_plan(1, shard_cols, target)[1]
    run(_shard_reduce_kernel)[(num_rows,)](partial, out, first_col, num_splits,
                                           BLOCK_SPLITS=triton.next_power_of_2(max(max_splits, num_splits)))
    return out


def shard_gumbel(seeds: torch.Tensor, counters: torch.Tensor, first_col: int, num_cols: int) -> torch.Tensor:
    """[N, num_cols] float32: columns first_col.. of the sampler's `gumbel_noise`, made for those ids only."""
    row_key = _mix64(_mix64(seeds + _GOLDEN) + (counters + 1) * _GOLDEN)                       # [N]
    ids = torch.arange(first_col, first_col + num_cols, dtype=torch.int64, device=seeds.device)   # [C]
    bits = _mix64(row_key[:, None] + (ids + 1)[None, :] * _GOLDEN)                              # [N, C]
    uniform = (_shift_right(bits, 41).float() + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(uniform))


def shard_best_torch(shard: torch.Tensor, first_col: int, temperature: torch.Tensor, seeds: torch.Tensor,
                     counters: torch.Tensor, greedy_mask: torch.Tensor) -> torch.Tensor:
    """`shard_best_triton` in torch ops, as the Sampler's torch path scores tokens (its CPU path)."""
    logits = shard.float()
    scores = logits / temperature[:, None] + shard_gumbel(seeds, counters, first_col, shard.shape[1])   # [N, C]
    scores = torch.where(greedy_mask[:, None], logits, scores)
    index = scores.argmax(dim=1, keepdim=True)                                          # [N, 1], the first best
    return torch.cat([scores.gather(1, index), (index + first_col).float()], dim=1)     # [N, 2]


def best_over_ranks(gathered: torch.Tensor, ranks: int) -> torch.Tensor:
    """[N] int64 tokens from every rank's (score, global id) side by side, [N, ranks * 2]: the best score, the lowest
    rank (so the lowest id) among equals."""
    per_rank = gathered.view(gathered.shape[0], ranks, 2)
    best_rank = per_rank[:, :, 0].argmax(dim=1, keepdim=True)                           # [N, 1]
    return per_rank[:, :, 1].gather(1, best_rank).squeeze(1).to(torch.int64)


# ---- one rank ---------------------------------------------------------------------------------------------------

class Inputs:
    """A step's inputs on one rank, in static buffers: its logits shard and the per-row sampling values; `fill(seed)`
    draws new ones (every rank draws the same whole rows) and returns the whole [N, V] logits for the reference."""

    def __init__(self, rows: int, vocab: int, rank: int, ranks: int, device: torch.device):
        self.rows, self.vocab, self.rank, self.ranks = rows, vocab, rank, ranks
        self.shard_cols = vocab // ranks
        self.first_col = rank * self.shard_cols
        self.shard = torch.empty(rows, self.shard_cols, dtype=torch.float32, device=device)   # [N, V / ranks]
        self.temperature = torch.empty(rows, dtype=torch.float32, device=device)              # [N], greedy: 1.0
        self.seeds = torch.empty(rows, dtype=torch.int64, device=device)
        self.counters = torch.empty(rows, dtype=torch.int64, device=device)                   # output tokens so far
        self.greedy_mask = (torch.arange(rows, device=device) % GREEDY_EVERY) == GREEDY_EVERY - 1   # [N] bool
        self.bitmask = torch.full((1, -(-vocab // 32)), -1, dtype=torch.int32, device=device)   # allows every id
        self.mask_index = torch.zeros(rows, dtype=torch.int64, device=device)                 # no row has a grammar

    def fill(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(self.rows, self.vocab, generator=g) * 4                          # [N, V]
        temperature = torch.rand(self.rows, generator=g) + 0.5
        greedy = self.greedy_mask.cpu()
        self.temperature.copy_(torch.where(greedy, 1.0, temperature))
        self.seeds.copy_(torch.randint(0, 2**62, (self.rows,), generator=g))
        self.counters.copy_(torch.randint(0, 4096, (self.rows,), generator=g))
        self.shard.copy_(logits[:, self.first_col:self.first_col + self.shard_cols])
        return logits.to(self.shard.device)

    def metadata(self, vocab: int):
        """The FULL decode graph's sampling metadata over these rows (see `graph_sampling_metadata`)."""
        from ember.runner.sampler import SamplingMetadata
        return SamplingMetadata(
            num_reqs=self.rows, vocab_size=vocab, all_greedy=False, all_random=False, greedy_mask=self.greedy_mask,
            temperature=self.temperature, top_k=None, max_top_k=0, top_p=None, min_p=None, seeds=self.seeds,
            output_lens=self.counters, prompt_mask=None, output_counts=None, repetition_penalty=None,
            presence_penalty=None, frequency_penalty=None, blocked_token_ids=None, max_num_logprobs=None,
            bitmask=self.bitmask, mask_index=self.mask_index)


def _step(design: str, inputs: Inputs, sampler, process_group):
    """One decode step of `design` on this rank, returning its [N] int64 tokens."""
    import torch.distributed as dist
    from ember.distributed import ops
    from ember.distributed.parallel_state import TP_GROUP
    meta = inputs.metadata(inputs.vocab)
    shard_best = shard_best_triton if inputs.shard.is_cuda else shard_best_torch

    def every_rank():
        return sampler(ops.all_gather(inputs.shard, TP_GROUP), meta).sampled_token_ids

    def rank0_broadcast():
        logits = ops.all_gather(inputs.shard, TP_GROUP)
        if inputs.rank == 0:
            tokens = sampler(logits, meta).sampled_token_ids
        else:
            tokens = torch.empty(inputs.rows, dtype=torch.int64, device=logits.device)   # [N], rank 0's to come
        dist.broadcast(tokens, src=0, group=process_group)
        return tokens

    def shard_local():
        best = shard_best(inputs.shard, inputs.first_col, inputs.temperature, inputs.seeds, inputs.counters,
                          inputs.greedy_mask)                                         # [N, 2]
        return best_over_ranks(ops.all_gather(best, TP_GROUP), inputs.ranks)

    return {"A": every_rank, "B": rank0_broadcast, "C": shard_local}[design]


def bytes_received(design: str, rows: int, vocab: int, ranks: int) -> int:
    """The most bytes any rank receives in one step of `design`."""
    logits = (ranks - 1) * rows * (vocab // ranks) * 4
    return {"A": logits, "B": logits + rows * 8, "C": (ranks - 1) * rows * 2 * 4}[design]


class Checks:
    """Rows whose tokens were compared with the reference, and what disagreed (reported, not raised: every rank must
    go on to the same collectives)."""

    def __init__(self, rank: int):
        self.rank, self.greedy_rows, self.sampled_rows, self.errors = rank, 0, 0, []

    def compare(self, got: torch.Tensor, want: torch.Tensor, greedy: torch.Tensor, what: str) -> None:
        wrong = (got.cpu() != want.cpu()).nonzero().flatten().tolist()
        self.greedy_rows += int(greedy.sum())
        self.sampled_rows += int((~greedy).sum())
        if wrong:
            self.errors.append(f"rank {self.rank} {what}: rows {wrong[:8]} differ from the whole-row sampler "
                               f"({len(wrong)} of {got.numel()})")


def _time(run, steps: int, reps: int, device: torch.device) -> float:
    """Median microseconds per step of `run()` (one round of `steps`), the ranks lined up before each round."""
    import torch.distributed as dist
    times = []
    for _ in range(reps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(1e3 * start.elapsed_time(end) / steps)
        else:
            start_s = time.perf_counter()
            run()
            times.append(1e6 * (time.perf_counter() - start_s) / steps)
    return statistics.median(times)


def _measure(design: str, inputs: Inputs, sampler, reference, process_group, checks: Checks, steps: int, reps: int,
             seed: int) -> dict[str, float]:
    """Eager (and on CUDA graph) microseconds per step of `design`, its tokens checked against `reference`."""
    step = _step(design, inputs, sampler, process_group)
    greedy = inputs.greedy_mask.cpu()
    logits = inputs.fill(seed)
    checks.compare(step(), reference(logits, inputs), greedy, f"{design} eager, {inputs.rows} rows")

    def round_():
        for _ in range(steps - 1):
            step()
        return step()
    result = {"eager": _time(round_, steps, reps, inputs.shard.device)}
    if not inputs.shard.is_cuda:
        return result
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        round_()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = round_()
    result["graph"] = _time(graph.replay, steps, reps, inputs.shard.device)
    logits = inputs.fill(seed + 1)
    graph.replay()
    torch.cuda.synchronize()
    checks.compare(tokens, reference(logits, inputs), greedy, f"{design} graph replay with new inputs, "
                                                             f"{inputs.rows} rows")
    del graph
    return result


def _rank(rank: int, ranks: int, port: int, device_type: str, rows_list: list[int], vocab: int, steps: int,
          reps: int, out) -> None:
    import datetime
    import torch.distributed as dist
    from ember.distributed import ops
    from ember.distributed.parallel_state import (COLLECTIVE_ENV, TP_GROUP, init_tensor_parallel,
                                                  leave_tensor_parallel)
    from ember.runner.sampler import Sampler
    for name, value in COLLECTIVE_ENV.items():
        os.environ.setdefault(name, value)
    if device_type == "cpu":
        torch.set_num_threads(1)        # one core a rank
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    init_tensor_parallel(rank, ranks, rank, device_type, store, 120.0, symm_mem_all_reduce=False)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    process_group = ops._groups[TP_GROUP].process_group
    sampler, whole_row = Sampler(), Sampler(use_triton=False)

    def reference(logits, inputs):
        return whole_row(logits, inputs.metadata(vocab)).sampled_token_ids

    checks, times = Checks(rank), {}
    for rows in rows_list:
        inputs = Inputs(rows, vocab, rank, ranks, device)
        for design in DESIGNS:
            try:
                for mode, us in _measure(design, inputs, sampler, reference, process_group, checks, steps, reps,
                                         seed=rows).items():
                    times[(rows, design, mode)] = us
            except Exception as e:      # noqa: BLE001 - reported in the table (every rank fails alike: the op)
                checks.errors.append(f"rank {rank} {design}, {rows} rows: {type(e).__name__}: {e}")
    gathered = [None] * ranks
    dist.all_gather_object(gathered, (times, checks.greedy_rows, checks.sampled_rows, checks.errors))
    if rank == 0:
        slowest = {key: max(g[0].get(key, float("nan")) for g in gathered) for key in times}
        out.put({"times": slowest, "greedy_rows": [g[1] for g in gathered], "sampled_rows": [g[2] for g in gathered],
                 "errors": [e for g in gathered for e in g[3]]})
    dist.barrier()
    leave_tensor_parallel()


def run_ranks(ranks: int, device_type: str, rows_list: list[int], vocab: int, steps: int, reps: int) -> dict:
    """Spawn the ranks and return rank 0's summary: times (slowest rank) per (rows, design, mode), the rows each rank
    checked (greedy, sampled) and every disagreement."""
    import multiprocessing as mp
    import queue
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ranks, port, device_type, rows_list, vocab, steps, reps, out))
             for r in range(ranks)]
    for proc in procs:
        proc.start()
    while True:
        try:
            results = out.get(timeout=5.0)
            break
        except queue.Empty:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
                raise SystemExit(f"a rank failed: exit codes {[proc.exitcode for proc in procs]}")
    for proc in procs:
        proc.join(30)
        if proc.is_alive():
            print(f"rank process {proc.pid} did not exit within 30 s of its results; killing it")
            proc.kill()
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, no graphs")
    p.add_argument("--rows", type=int, nargs="+", default=ROWS, help="rows (requests) a step samples")
    p.add_argument("--vocab", type=int, default=None, help=f"vocabulary size (default {VOCAB}; {CPU_VOCAB} on cpu)")
    p.add_argument("--steps", type=int, default=20, help="steps a timed round")
    p.add_argument("--reps", type=int, default=20, help="rounds; the median is reported")
    args = p.parse_args(argv)
    vocab = args.vocab or (CPU_VOCAB if args.device == "cpu" else VOCAB)
    if args.ranks < 2:
        p.error(f"--ranks {args.ranks}: the designs differ only across 2 or more ranks")
    if vocab % args.ranks:
        p.error(f"--vocab {vocab} does not split evenly over {args.ranks} ranks; give a multiple of {args.ranks}")
    if vocab >= 2**24:
        p.error(f"--vocab {vocab}: C sends token ids as float32, exact below 2**24; give a smaller vocabulary")
    if min(args.rows) < 1 or args.steps < 1 or args.reps < 1:
        p.error("--rows, --steps and --reps must be at least 1")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        p.error(f"--ranks {args.ranks} needs as many GPUs; this host has {torch.cuda.device_count()}")
    results = run_ranks(args.ranks, args.device, args.rows, vocab, args.steps, args.reps)
    times = results["times"]
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo, torch sampler, no graphs)"
    print(f"{where}, {args.ranks} ranks, V = {vocab} ({vocab // args.ranks} a rank), float32 logits, 1 row in "
          f"{GREEDY_EVERY} greedy; median of {args.reps} rounds of {args.steps} steps, the slowest rank "
          f"(us per step; x A: the ratio to A)")
    print(f"{'rows':>5} {'design':<21} {'bytes in/rank':>13} {'eager us':>9} {'x A':>6} {'graph us':>9} {'x A':>6}")
    for rows in args.rows:
        for design, name in DESIGNS.items():
            cells = []
            for mode in ("eager", "graph"):
                us, base = times.get((rows, design, mode)), times.get((rows, "A", mode))
                cells += [f"{us:.1f}", f"{us / base:.2f}"] if us is not None and base else ["-", "-"]
            print(f"{rows:>5} {design + ' ' + name:<21} {bytes_received(design, rows, vocab, args.ranks):>13} "
                  f"{cells[0]:>9} {cells[1]:>6} {cells[2]:>9} {cells[3]:>6}")
    print("B: NCCL has no gather to one rank; a gather would bring rank 0 what the all-gather brings every rank (on 2 "
          "ranks, the other's shard either way)" + ("; the broadcast is recorded in every rank's graph (checked: a "
          "replay with new inputs gives every rank rank 0's new tokens)" if args.device == "cuda" else ""))
    print("C: exact only for temperature sampling and greedy rows; top-k/top-p/min-p, penalties, min_tokens and "
          "logprobs need the whole row (A or B)")
    print(f"checked per rank against the torch sampler over the whole row: greedy rows {results['greedy_rows']}, "
          f"sampled rows {results['sampled_rows']} (A, B and C, exactly)")
    for error in results["errors"]:
        print("  " + error)
    print("agreement: " + ("all tokens equal" if not results["errors"] else f"{len(results['errors'])} disagreements"))
    raise SystemExit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
