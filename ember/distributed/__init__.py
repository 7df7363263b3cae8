"""Tensor parallelism on `torch.distributed`: one process a GPU (NCCL on CUDA, gloo on the CPU).

- `parallel_state`: this process's rank among the tensor-parallel ranks and the groups they share.
- `shard`: which slice of each layer a rank holds (heads, KV heads replicated where fewer than ranks, vocabulary).
- `ops`: `ember::all_reduce` and `ember::all_gather`, custom ops that dynamo traces and CUDA graphs capture;
  `symm_mem`: the one-shot symmetric-memory all-reduce for small messages.
- `channel`: how each step's `StepInput` reaches the other ranks.

The processes that run `ModelRunner`s on these groups (`make_executor`, the workers) sit a layer above the runner, in
`ember.executor`; nothing here imports the runner or the models.
"""
