"""How tensor-parallel ranks come to the same sampled tokens, per decode step, timed three ways over N rows of a
vocabulary V split across the ranks (each holds [N, V / ranks] float32 logits, as the vocab-parallel LM head leaves
them), eagerly and inside a CUDA graph:

  A  every rank: `ember::all_gather` of the shards into [N, V] on every rank, then ember's Sampler on every rank
     (the engine's gathered path: docs/distributed.md, "Sampling on every rank").
  B  rank 0 + broadcast: the same all-gather (NCCL has no gather to one rank, and a gather would bring rank 0 the same
     bytes an all-gather brings every rank), the Sampler on rank 0 only, then torch.distributed.broadcast of the
     [N] int64 tokens from rank 0, captured in the graph of every rank.
  C  shard-local: each rank runs the Sampler's first pass (`ember.kernels.sampling.sample_partials`) over its own
     columns, scoring each token by its global id (logits / T + the counter-based Gumbel noise, the grammar bitmask's
     bit; greedy rows: the logits) into a few (best score, id) partials a row, then an all-gather of the partials
     [N, 2, splits] and the Sampler's own reduce over all of them (ties: the lowest id). Exact for temperature
     sampling, greedy rows and grammar bitmasks; top-k/top-p/min-p, penalties, min_tokens and logprobs need the
     whole row. The engine's shard-local path (ember.runner.sampler.shard_local).

The Sampler gets the general form the FULL decode graph records (`graph_sampling_metadata`: temperature per row,
greedy rows by mask, the grammar bitmask buffer with no row under a grammar), built directly as a SamplingMetadata
rather than gathered from a RequestTable: that gather of N rows is the same work in all three designs. On CUDA the
Sampler runs its one-pass Triton kernel, and C the same kernel's two passes around its all-gather; on the CPU the
Sampler runs its torch path and C the kernel interpreted.

Every result is checked on every rank: A's, B's and C's tokens must equal those of the torch sampler over the whole
row, which every rank draws alike (greedy and sampled rows, exactly); in a graph, after the inputs are filled anew.

    PYTHONPATH=. python benches/tp_sampling.py --ranks 2                      # 2 GPUs, N 1 8 64 256, V 128256
    PYTHONPATH=. python benches/tp_sampling.py --device cpu --ranks 2 --vocab 1000 --rows 1 8
"""

from __future__ import annotations

import argparse
import os

import torch

from benches.ranks import captured, median_us_per_call, spawn_ranks
from ember.kernels import sampling as SK

ROWS = [1, 8, 64, 256]
VOCAB = 128256          # Llama-3's
CPU_VOCAB = 1000
DESIGNS = {"A": "every rank", "B": "rank 0 + broadcast", "C": "shard-local"}
GREEDY_EVERY = 4        # rows i with i % 4 == 3 are greedy: a batch of 1 samples, one of 8 holds both kinds


# ---- C's shard-local sampling -------------------------------------------------------------------------------

def shard_partials(inputs: "Inputs") -> torch.Tensor:
    """[N, 2, splits]: this rank's best (score, token id) per split of its columns, each token scored as the
    Sampler's one-pass kernel scores the whole row (`sample_partials` with the shard's first id; CPU tensors run
    the kernel interpreted)."""
    return SK.sample_partials(inputs.shard, inputs.temperature, inputs.seeds, inputs.counters, inputs.greedy_mask,
                              False, inputs.bitmask, inputs.mask_index, first_id=inputs.first_col)


def best_over_ranks(gathered: torch.Tensor, ranks: int) -> torch.Tensor:
    """[N] int64 tokens from every rank's partials side by side, [N, ranks * 2 * splits]: laid out as one
    [N, 2, ranks * splits] and reduced by the Sampler's own reduce (ties: the lowest id)."""
    rows = gathered.shape[0]
    return SK.reduce_partials(gathered.view(rows, ranks, 2, -1).transpose(1, 2).reshape(rows, 2, -1))


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
        partials = shard_partials(inputs).view(inputs.rows, -1)                       # [N, 2 * splits]
        return best_over_ranks(ops.all_gather(partials, TP_GROUP), inputs.ranks)

    return {"A": every_rank, "B": rank0_broadcast, "C": shard_local}[design]


def bytes_received(design: str, rows: int, vocab: int, ranks: int, splits: int = 1) -> int:
    """The most bytes any rank receives in one step of `design` (C: `splits` partials a row and rank)."""
    logits = (ranks - 1) * rows * (vocab // ranks) * 4
    return {"A": logits, "B": logits + rows * 8, "C": (ranks - 1) * rows * 2 * splits * 4}[design]


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
    result = {"eager": median_us_per_call(round_, steps, reps, inputs.shard.device)}
    if not inputs.shard.is_cuda:
        return result
    graph, tokens = captured(round_)
    result["graph"] = median_us_per_call(graph.replay, steps, reps, inputs.shard.device)
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
    return spawn_ranks(_rank, ranks, device_type, rows_list, vocab, steps, reps)


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
    if min(args.rows) < 1 or args.steps < 1 or args.reps < 1:
        p.error("--rows, --steps and --reps must be at least 1")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        p.error(f"--ranks {args.ranks} needs as many GPUs; this host has {torch.cuda.device_count()}")
    results = run_ranks(args.ranks, args.device, args.rows, vocab, args.steps, args.reps)
    times = results["times"]
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (gloo, no graphs; A and B the torch sampler, C its kernel interpreted: CPU times say nothing of C)"
    print(f"{where}, {args.ranks} ranks, V = {vocab} ({vocab // args.ranks} a rank), float32 logits, 1 row in "
          f"{GREEDY_EVERY} greedy; median of {args.reps} rounds of {args.steps} steps, the slowest rank "
          f"(us per step; x A: the ratio to A)")
    print(f"{'rows':>5} {'design':<21} {'bytes in/rank':>13} {'eager us':>9} {'x A':>6} {'graph us':>9} {'x A':>6}")
    target = SK._num_programs_target(torch.device(args.device))
    for rows in args.rows:
        splits = SK.split_plan(rows, vocab // args.ranks, target)[1]
        for design, name in DESIGNS.items():
            cells = []
            for mode in ("eager", "graph"):
                us, base = times.get((rows, design, mode)), times.get((rows, "A", mode))
                cells += [f"{us:.1f}", f"{us / base:.2f}"] if us is not None and base else ["-", "-"]
            print(f"{rows:>5} {design + ' ' + name:<21} {bytes_received(design, rows, vocab, args.ranks, splits):>13} "
                  f"{cells[0]:>9} {cells[1]:>6} {cells[2]:>9} {cells[3]:>6}")
    print("B: NCCL has no gather to one rank; a gather would bring rank 0 what the all-gather brings every rank (on 2 "
          "ranks, the other's shard either way)" + ("; the broadcast is recorded in every rank's graph (checked: a "
          "replay with new inputs gives every rank rank 0's new tokens)" if args.device == "cuda" else ""))
    print("C: exact for temperature sampling, greedy rows and grammar bitmasks; top-k/top-p/min-p, penalties, "
          "min_tokens and logprobs need the whole row (A or B)")
    print(f"checked per rank against the torch sampler over the whole row: greedy rows {results['greedy_rows']}, "
          f"sampled rows {results['sampled_rows']} (A, B and C, exactly)")
    for error in results["errors"]:
        print("  " + error)
    print("agreement: " + ("all tokens equal" if not results["errors"] else f"{len(results['errors'])} disagreements"))
    raise SystemExit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
