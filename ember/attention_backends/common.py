"""`CommonAttentionMetadata`: the per-step batch description every backend's builder starts from."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CommonAttentionMetadata:
    """One step's batch, as views into persistent buffers (so CUDA graphs see stable addresses).

    Requests are ordered decodes first: the first `num_decodes` requests have exactly one query token.
    Rows past `num_reqs` (up to `num_reqs_padded`) are padding: zero-length queries, seq_len 0, slot -1.
    Tokens past `num_actual_tokens` (up to `num_tokens_padded`) are padding too.
    Host-side integers describe the live batch; kernels whose choice must be replayable decide from
    `num_tokens_padded`, `num_reqs_padded`, `uniform_decode` and `max_seq_len_bound` only.
    """
    query_start_loc: torch.Tensor        # [num_reqs_padded + 1] int32, device
    seq_lens: torch.Tensor               # [num_reqs_padded] int32, device: context + new tokens
    query_start_loc_cpu: torch.Tensor    # [num_reqs_padded + 1] int32, host
    seq_lens_cpu: torch.Tensor           # [num_reqs_padded] int32, host
    block_tables: tuple[torch.Tensor, ...]   # per KV-cache group: [num_reqs_padded, max_blocks_per_req] int32
    slot_mappings: tuple[torch.Tensor, ...]  # per KV-cache group: [num_tokens_padded] int64, -1 = write nothing
    num_reqs: int
    num_actual_tokens: int
    num_reqs_padded: int
    num_tokens_padded: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int                     # leading requests with query_len == 1
    uniform_decode: bool                 # every live request is a single-token decode
    # no request is longer than this (a short-context decode graph's bound, replayable), or None
    max_seq_len_bound: int | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_prefills(self) -> int:
        return self.num_reqs - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_actual_tokens - self.num_decodes
