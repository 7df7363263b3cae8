"""Tensor parallelism on `torch.distributed`: one process a GPU (NCCL on CUDA, gloo on the CPU).

- `parallel_state`: this process's rank among the tensor-parallel ranks and the groups they share.
- `shard`: which slice of each layer a rank holds (heads, KV heads replicated where fewer than ranks, vocabulary).
- `ops`: `ember::all_reduce` and `ember::all_gather`, custom ops that dynamo traces and CUDA graphs capture;
  `symm_mem`: the one-shot symmetric-memory all-reduce for small messages.
- `channel`: how each step's `StepInput` reaches the other ranks.
- `executor` and `worker` (the runner's layer): `make_executor` gives the engine rank 0's `ModelRunner`, or a
  `MultiprocExecutor` that runs it beside the worker processes of ranks 1..N-1.
"""
