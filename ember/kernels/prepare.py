"""Prepare a step's inputs on the device from the persistent request table.

Given, per batch row, the table row it reads (`idx_mapping`), the start of its chunk (`starts`, its computed
token count) and its query length (`query_lens`, 0 for padding rows), write in place:
    query_start_loc [R_pad + 1] int32, seq_lens [R_pad] int32, logits_indices [R_pad] int64,
    input_ids [T_pad] int64 and positions [T_pad] int64 (read from the table's token ids),
    slot_mappings [G, T_pad] int64 (from the table's block rows, one per KV-cache group).
Padding tokens (past the live tokens, up to T_pad) get id 0, position 0 and slot -1 (write nothing).

`prepare_inputs` runs one Triton program per batch row on CUDA (or under TRITON_INTERPRET=1) and vectorised
torch ops otherwise. This module imports nothing from ember.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from ember.kernels.interpret import interpreter_on
from ember.kernels.launcher import launcher


def prepare_inputs(idx_mapping: torch.Tensor, starts: torch.Tensor, query_lens: torch.Tensor,
                   token_ids: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_tokens: int,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, logits_indices: torch.Tensor,
                   input_ids: torch.Tensor, positions: torch.Tensor, slot_mappings: torch.Tensor,
                   use_triton: bool | None = None, max_num_rows: int = 0) -> None:
    """Fill the output buffers for R_pad = len(idx_mapping) rows and T_pad = input_ids.numel() tokens.

    token_ids [num_table_rows, width] (any int dtype), block_tables [G, num_table_rows, max_blocks] int32;
    `num_tokens` is the live token count, sum(query_lens), known on the host. use_triton: None picks Triton
    for CUDA tensors. `max_num_rows`, the most rows any step has, fixes the kernel's row tile so that one
    compiled kernel serves every batch size."""
    num_rows = idx_mapping.numel()
    if not (starts.numel() == query_lens.numel() == num_rows and query_start_loc.numel() >= num_rows + 1):
        raise ValueError(f"idx_mapping ({num_rows}), starts ({starts.numel()}), query_lens ({query_lens.numel()}) "
                         f"and query_start_loc ({query_start_loc.numel()}, needs {num_rows + 1}) disagree")
    if num_tokens > input_ids.numel():
        raise ValueError(f"{num_tokens} live tokens exceed the {input_ids.numel()} input slots")
    if use_triton is None:
        use_triton = input_ids.is_cuda
    if use_triton:
        _prepare_triton(idx_mapping, starts, query_lens, token_ids, block_tables, block_size, query_start_loc,
                        seq_lens, logits_indices, input_ids, positions, slot_mappings, max(max_num_rows, num_rows))
    else:
        _prepare_torch(idx_mapping, starts, query_lens, token_ids, block_tables, block_size, num_tokens,
                       query_start_loc, seq_lens, logits_indices, input_ids, positions, slot_mappings)


def _prepare_torch(idx_mapping, starts, query_lens, token_ids, block_tables, block_size, num_tokens,
                   query_start_loc, seq_lens, logits_indices, input_ids, positions, slot_mappings) -> None:
    num_rows = idx_mapping.numel()
    qlens = query_lens.to(torch.int64)
    ends = torch.cumsum(qlens, 0)                                                   # [R_pad]
    query_start_loc[0] = 0
    query_start_loc[1:num_rows + 1] = ends.to(query_start_loc.dtype)
    seq_lens[:num_rows] = (starts + qlens).to(seq_lens.dtype)
    logits_indices[:num_rows] = ends - 1
    # each live token's batch row, then its position inside the request
    row_of_token = torch.repeat_interleave(torch.arange(num_rows, device=qlens.device), qlens,
                                           output_size=num_tokens)                  # [T]
    offset = torch.arange(num_tokens, device=qlens.device) - (ends - qlens)[row_of_token]
    pos = starts.to(torch.int64)[row_of_token] + offset                             # [T]
    rows = idx_mapping.to(torch.int64)[row_of_token]                                # [T]
    input_ids[:num_tokens] = token_ids[rows, pos].to(input_ids.dtype)
    positions[:num_tokens] = pos
    blocks = block_tables[:, rows, pos // block_size].to(torch.int64)              # [G, T]
    slot_mappings[:, :num_tokens] = blocks * block_size + pos % block_size
    input_ids[num_tokens:] = 0
    positions[num_tokens:] = 0
    slot_mappings[:, num_tokens:] = -1


def _prepare_triton(idx_mapping, starts, query_lens, token_ids, block_tables, block_size, query_start_loc,
                    seq_lens, logits_indices, input_ids, positions, slot_mappings, max_num_rows: int) -> None:
    kernel = _kernel(not input_ids.is_cuda)
    num_rows = idx_mapping.numel()
    num_groups = block_tables.shape[0]
    # one program per row plus one for the padding tail; BLOCK_ROWS covers every row so each program can sum
    # the query lengths before it (its token offset) without a separate scan
    kernel[(num_rows + 1,)](
        idx_mapping, starts, query_lens, token_ids, token_ids.stride(0), block_tables, block_tables.stride(0),
        block_tables.stride(1), query_start_loc, seq_lens, logits_indices, input_ids, positions, slot_mappings,
        slot_mappings.stride(0), num_rows, input_ids.numel(), block_size,
        NUM_GROUPS=num_groups, BLOCK_ROWS=_next_pow2(max_num_rows), BLOCK_TOKENS=128)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _kernel(interpreted: bool):
    """The compiled kernel, or for CPU tensors an interpreted copy (whatever TRITON_INTERPRET said at import)."""
    name = "ember.kernels.prepare_triton"
    if not interpreted:
        return launcher(importlib.import_module(name).prepare_inputs_kernel)
    # the kernel module imported a second time with TRITON_INTERPRET=1, so that it runs on CPU tensors
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    with interpreter_on():
        spec.loader.exec_module(module)
    return module.prepare_inputs_kernel
