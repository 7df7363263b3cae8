"""Persistent input buffers: a `SchedulerOutput` is written into host buffers, copied into device buffers
allocated once, and described by a `CommonAttentionMetadata` of views into them (CUDA-graph safe)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ember.attention_backends.common import CommonAttentionMetadata
from ember.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class PreparedBatch:
    """What one step's forward reads: padded inputs, attention metadata and where each request's logits are."""
    input_ids: torch.Tensor        # [num_tokens_padded] int64, device
    positions: torch.Tensor        # [num_tokens_padded] int64, device
    logits_indices: torch.Tensor   # [num_reqs] int64, device: each request's last scheduled token
    common: CommonAttentionMetadata
    logits_indices_padded: torch.Tensor | None = None   # [num_reqs_padded] int64: padding rows point at token 0
    # the same requests with only their last token as the query: what a prefill-skipping tail of KV-sharing
    # layers attends with (None unless the model has such a tail)
    tail: CommonAttentionMetadata | None = None


class _DummyRequest:
    """Stands in for a request in warm-up batches: token 0 everywhere."""
    request_id = "__dummy__"
    num_tokens = 1 << 62       # every position is known on the host

    def token_at(self, i: int) -> int:
        return 0

    @property
    def all_token_ids(self) -> "_Zeros":
        return _Zeros()


class _Zeros:
    def __getitem__(self, item: slice) -> list[int]:
        return [0] * len(range(*item.indices(item.stop)))


@dataclass(frozen=True)
class _DummyScheduled:
    num_new_tokens: int
    num_groups: int
    num_computed_tokens: int = 0
    request: _DummyRequest = _DummyRequest()

    @property
    def block_ids(self) -> tuple[None, ...]:
        return (None,) * self.num_groups


class _Buffer:
    """A device tensor with a host mirror (pinned on CUDA) and a numpy view of the mirror."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, fill: int = 0):
        self.host = torch.full(shape, fill, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.device = torch.full(shape, fill, dtype=dtype, device=device)

    def copy(self, n: int) -> torch.Tensor:
        """Copy the first `n` rows to the device (asynchronously on CUDA) and return the device view."""
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class InputBatch:
    """Turns scheduled requests into the step's input tensors, reusing the same buffers every step."""

    def __init__(self, num_groups: int, block_size: int, max_num_reqs: int, max_num_tokens: int,
                 max_model_len: int, device: torch.device, tail_metadata: bool = False):
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)               # [T]
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)               # [T]
        self.query_start_loc = _Buffer((max_num_reqs + 1,), torch.int32, device)       # [R + 1]
        self.seq_lens = _Buffer((max_num_reqs,), torch.int32, device)                  # [R]
        self.logits_indices = _Buffer((max_num_reqs,), torch.int64, device)            # [R]
        # one query per request for a prefill-skipping tail: query_start_loc 0, 1, ..., slots never written
        self.tail_query_start_loc = _Buffer((max_num_reqs + 1,), torch.int32, device) if tail_metadata else None
        self.tail_slot_mappings = tuple(torch.full((max_num_reqs,), -1, dtype=torch.int64, device=device)
                                        for _ in range(num_groups)) if tail_metadata else ()
        self.block_tables = [_Buffer((max_num_reqs, self.max_blocks_per_req), torch.int32, device)
                             for _ in range(num_groups)]                               # [R, max_blocks]
        self.slot_mappings = [_Buffer((max_num_tokens,), torch.int64, device, fill=-1)
                              for _ in range(num_groups)]                              # [T]
        # decode inputs still on the device (sampled by the step in flight): rows here <- rows there
        self.pending_dst = _Buffer((max_num_reqs,), torch.int64, device)               # [R]
        self.pending_src = _Buffer((max_num_reqs,), torch.int64, device)               # [R]
        # the host buffers are rewritten each step, so the last step's asynchronous copies out of them must have
        # finished first; the engine's per-step sync usually guarantees it, this event makes it explicit
        self._copies_done = torch.cuda.Event() if device.type == "cuda" else None
        # per group and row: the block list written there last step and how much of it (see _write_row)
        self._row_lists: list[list] = [[None] * max_num_reqs for _ in range(num_groups)]
        self._row_lens: list[list[int]] = [[0] * max_num_reqs for _ in range(num_groups)]

    def prepare_dummy(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                      num_reqs_padded: int | None = None) -> PreparedBatch:
        """A batch of the given shape that touches only the null block (for warm-up, profiling and capture):
        tokens split evenly over `num_reqs` requests, every slot -1, every block-table entry 0."""
        num_reqs = max(1, min(num_reqs, num_tokens))
        per_req, extra = divmod(num_tokens, num_reqs)
        query_lens = [per_req + (r < extra) for r in range(num_reqs)]
        fake = [_DummyScheduled(n, len(self.slot_mappings)) for n in query_lens]
        out = SchedulerOutput(tuple(fake), sum(1 for n in query_lens if n == 1))
        return self.prepare(out, num_tokens, num_reqs_padded or num_reqs, uniform_decode)

    def _tail(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """`common` with one query per request, its last token (padding requests keep zero-length queries)."""
        num_reqs, num_reqs_padded = common.num_reqs, common.num_reqs_padded
        qsl = self.tail_query_start_loc.np
        qsl[:num_reqs + 1] = np.arange(num_reqs + 1)
        qsl[num_reqs + 1:num_reqs_padded + 1] = num_reqs
        return dataclasses.replace(
            common, query_start_loc=self.tail_query_start_loc.copy(num_reqs_padded + 1),
            query_start_loc_cpu=self.tail_query_start_loc.host[:num_reqs_padded + 1],
            slot_mappings=tuple(m[:num_reqs_padded] for m in self.tail_slot_mappings),
            num_actual_tokens=num_reqs, num_tokens_padded=num_reqs_padded, max_query_len=1 if num_reqs else 0,
            num_decodes=num_reqs, uniform_decode=True)

    def _write_row(self, g: int, r: int, blocks: list[int] | tuple[int, ...]) -> None:
        """Put a request's block ids in row r of group g's table, writing only what changed since last step
        (in steady decoding a row gains one block every block_size steps)."""
        known = self._row_lists[g][r]
        start = self._row_lens[g][r] if known is blocks else 0
        if start < len(blocks):
            self.block_tables[g].np[r, start:len(blocks)] = blocks[start:]
        self._row_lists[g][r] = blocks
        self._row_lens[g][r] = len(blocks)

    def _prepare_decodes(self, decodes, prev_rows: dict[str, int] | None) -> tuple[int, int]:
        """Single-token queries, vectorised: rows [0, D) hold tokens [0, D). Returns D and how many of their
        input tokens are still on the device (written to the pending buffers as (row, row in prev step))."""
        d = len(decodes)
        if d == 0:
            return 0, 0
        bs = self.block_size
        starts = np.fromiter((s.num_computed_tokens for s in decodes), dtype=np.int64, count=d)
        ids = self.input_ids.np
        num_pending = 0
        for r, s in enumerate(decodes):
            req, i = s.request, s.num_computed_tokens
            if i < req.num_tokens:
                ids[r] = req.token_at(i)
                continue
            # sampled by the step in flight: copied on the device from that step's output
            if prev_rows is None or req.request_id not in prev_rows:
                raise RuntimeError(f"request {req.request_id!r} needs its token at position {i}, which no step "
                                   f"in flight produces")
            ids[r] = 0
            self.pending_dst.np[num_pending] = r
            self.pending_src.np[num_pending] = prev_rows[req.request_id]
            num_pending += 1
        self.positions.np[:d] = starts
        rows = np.arange(d)
        self.query_start_loc.np[1:d + 1] = rows + 1
        self.seq_lens.np[:d] = starts + 1
        self.logits_indices.np[:d] = rows
        for g in range(len(self.block_tables)):
            if decodes[0].block_ids[g] is None:    # dummy batches are dummy throughout: null block, no writes
                self.block_tables[g].np[:d] = 0
                self._row_lists[g][:d] = [None] * d
                self.slot_mappings[g].np[:d] = -1
                continue
            for r, s in enumerate(decodes):
                self._write_row(g, r, s.block_ids[g])
            table = self.block_tables[g].np
            self.slot_mappings[g].np[:d] = table[rows, starts // bs] * bs + starts % bs
        return d, num_pending

    def prepare(self, out: SchedulerOutput, num_tokens_padded: int | None = None,
                num_reqs_padded: int | None = None, uniform_decode: bool | None = None,
                prev_sampled: torch.Tensor | None = None, prev_rows: dict[str, int] | None = None) -> PreparedBatch:
        """Fill the buffers for this step; rows past the live batch (up to the padded sizes) are padding.

        A decode whose input token was sampled by the step still in flight takes it on the device from
        `prev_sampled` [prev num_reqs] int64, at the row `prev_rows[request_id]` names."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
        num_reqs = len(out.scheduled)
        num_tokens = out.total_num_tokens
        num_tokens_padded = num_tokens_padded or num_tokens
        num_reqs_padded = num_reqs_padded or num_reqs
        if num_tokens_padded > self.max_num_tokens or num_reqs_padded > self.max_num_reqs:
            raise ValueError(f"batch of {num_tokens_padded} tokens / {num_reqs_padded} requests exceeds the "
                             f"buffers ({self.max_num_tokens} / {self.max_num_reqs})")
        bs = self.block_size
        ids, pos, qsl, lens, logit_idx = (self.input_ids.np, self.positions.np, self.query_start_loc.np,
                                          self.seq_lens.np, self.logits_indices.np)
        qsl[0] = 0
        num_decodes = out.num_decodes
        t, num_pending = self._prepare_decodes(out.scheduled[:num_decodes], prev_rows)
        max_query_len = 1 if num_decodes else 0
        max_seq_len = int(lens[:num_decodes].max()) if num_decodes else 0
        for r in range(num_decodes, num_reqs):
            s = out.scheduled[r]
            n, start = s.num_new_tokens, s.num_computed_tokens
            ids[t:t + n] = s.request.all_token_ids[start:start + n]
            positions = np.arange(start, start + n)
            pos[t:t + n] = positions
            for g, blocks in enumerate(s.block_ids):
                if blocks is None:      # a dummy request: null block, no writes
                    self.block_tables[g].np[r, :] = 0
                    self._row_lists[g][r] = None
                    self.slot_mappings[g].np[t:t + n] = -1
                    continue
                self._write_row(g, r, blocks)
                table = self.block_tables[g].np[r]
                self.slot_mappings[g].np[t:t + n] = table[positions // bs] * bs + positions % bs
            t += n
            qsl[r + 1] = t
            lens[r] = start + n
            logit_idx[r] = t - 1
            max_query_len = max(max_query_len, n)
            max_seq_len = max(max_seq_len, start + n)
        # padding: zero-length queries, empty sequences, null slots
        qsl[num_reqs + 1:num_reqs_padded + 1] = t
        lens[num_reqs:num_reqs_padded] = 0
        logit_idx[num_reqs:num_reqs_padded] = 0
        ids[t:num_tokens_padded] = 0
        pos[t:num_tokens_padded] = 0
        for g in range(len(self.slot_mappings)):
            self.slot_mappings[g].np[t:num_tokens_padded] = -1

        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.copy(num_reqs_padded + 1),
            seq_lens=self.seq_lens.copy(num_reqs_padded),
            query_start_loc_cpu=self.query_start_loc.host[:num_reqs_padded + 1],
            seq_lens_cpu=self.seq_lens.host[:num_reqs_padded],
            block_tables=tuple(b.copy(num_reqs_padded) for b in self.block_tables),
            slot_mappings=tuple(m.copy(num_tokens_padded) for m in self.slot_mappings),
            num_reqs=num_reqs, num_actual_tokens=num_tokens,
            num_reqs_padded=num_reqs_padded, num_tokens_padded=num_tokens_padded,
            max_query_len=max_query_len, max_seq_len=max_seq_len, num_decodes=out.num_decodes,
            uniform_decode=(out.num_decodes == num_reqs) if uniform_decode is None else uniform_decode,
        )
        input_ids = self.input_ids.copy(num_tokens_padded)
        if num_pending:
            dst, src = self.pending_dst.copy(num_pending), self.pending_src.copy(num_pending)
            input_ids.index_copy_(0, dst, prev_sampled.index_select(0, src))
        logits_padded = self.logits_indices.copy(num_reqs_padded)
        batch = PreparedBatch(input_ids, self.positions.copy(num_tokens_padded), logits_padded[:num_reqs], common,
                              logits_padded, self._tail(common) if self.tail_query_start_loc is not None else None)
        if self._copies_done is not None:
            self._copies_done.record()
        return batch
