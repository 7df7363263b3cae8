"""The step's persistent input buffers (allocated once, so CUDA graphs see stable addresses), filled from the
request table by the prepare-inputs kernel and described by a `CommonAttentionMetadata` of views into them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ember.attention_backends.common import CommonAttentionMetadata
from ember.kernels.prepare import prepare_inputs
from ember.runner.request_table import RequestTable
from ember.runner.upload import PackedUpload

ROW_INFO = 6     # rows of InputBatch.row_info


@dataclass(frozen=True)
class PreparedBatch:
    """What one step's forward reads: padded inputs, attention metadata and where each request's logits are."""
    input_ids: torch.Tensor        # [num_tokens_padded] int64, device
    positions: torch.Tensor        # [num_tokens_padded] int64, device
    logits_indices: torch.Tensor   # [num_reqs] int64, device: each request's last scheduled token
    idx_mapping: torch.Tensor      # [num_reqs] int64, device: each batch row's table row
    common: CommonAttentionMetadata
    # [num_reqs_padded] int64, device: flat token_ids index each row's sampled token goes to (padding rows and rows
    # part-way through a prompt: a spare column)
    sample_index: torch.Tensor | None = None
    logits_indices_padded: torch.Tensor | None = None   # [num_reqs_padded] int64: padding rows at a live token
    # the same requests with only their last token as the query: what a prefill-skipping tail of KV-sharing
    # layers attends with (None unless the model has such a tail)
    tail: CommonAttentionMetadata | None = None
    mask_index: torch.Tensor | None = None   # [num_reqs_padded] int64: grammar bitmask row + 1, 0 for none


@dataclass(frozen=True)
class BatchLayout:
    """The host's view of one step's batch: table rows, chunk starts and query lengths, in batch order."""
    rows: np.ndarray               # [num_reqs] int64
    starts: np.ndarray             # [num_reqs] int64: computed tokens before the chunk
    query_lens: np.ndarray         # [num_reqs] int64
    num_decodes: int

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


@dataclass(frozen=True)
class _Views:
    """Views into `InputBatch`'s buffers for one (padded rows, padded tokens, live rows) shape."""
    info: torch.Tensor
    idx: torch.Tensor
    starts: torch.Tensor
    qlens: torch.Tensor
    sample_index: torch.Tensor
    mask_index: torch.Tensor
    position: torch.Tensor
    idx_live: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    logits_indices_padded: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mappings: torch.Tensor
    block_tables: tuple
    slot_mapping_rows: tuple


class InputBatch:
    """Input ids, positions, slot mappings, query_start_loc, seq_lens, logits indices and batch-ordered block
    tables, rewritten in place each step."""

    def __init__(self, num_groups: int, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 device: torch.device, tail_metadata: bool = False):
        self.max_num_reqs, self.max_num_tokens, self.device = max_num_reqs, max_num_tokens, device
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)                # [T]
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)                # [T]
        self.slot_mappings = torch.full((num_groups, max_num_tokens), -1, dtype=torch.int64, device=device)  # [G, T]
        self.query_start_loc = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=device)        # [R + 1]
        self.seq_lens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)                   # [R]
        self.logits_indices = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)             # [R]
        # per batch row: table row, chunk start, query length, sampled token's flat index, grammar bitmask row + 1
        # (0: none), n > 0 where the start is the device's token count less n (a position row of async speculation);
        # copied out of the step's upload so that a CUDA graph finds them at one address
        self.row_info = torch.zeros(ROW_INFO, max_num_reqs, dtype=torch.int64, device=device)        # [6, R]
        self.block_tables = torch.zeros(num_groups, max_num_reqs, max_blocks_per_req, dtype=torch.int32,
                                        device=device)                                                # [G, R, B]
        # one query per request for a prefill-skipping tail: query_start_loc 0, 1, ..., slots never written
        self.tail_query_start_loc = (torch.arange(max_num_reqs + 1, dtype=torch.int32, device=device)
                                     if tail_metadata else None)                                  # [R + 1]
        self.tail_slot_mappings = torch.full((num_groups, max_num_reqs), -1, dtype=torch.int64, device=device)
        self._view_cache: dict[tuple[int, int, int], _Views] = {}

    def stage(self, layout: BatchLayout, num_reqs_padded: int, upload: PackedUpload, spare_index: int,
              sample_index: np.ndarray | None = None, grammar_rows: tuple[int, ...] = (),
              position_rows: tuple[int, ...] = (), position_back: int = 1) -> tuple:
        """Put the batch's rows, starts, query lengths, sampled-token indices, grammar bitmask rows and position
        flags in the upload (padding rows: row 0, start 0, length 0, index `spare_index`, no bitmask, no flag;
        without `sample_index` every row's token goes to `spare_index`). `grammar_rows[j]` samples under bitmask
        row j; `position_rows` take their start from the device (`InputBatch.prepare`'s `before_inputs`):
        `position_back` tokens before the row's device token count."""
        if num_reqs_padded > self.max_num_reqs:
            raise ValueError(f"batch of {num_reqs_padded} requests exceeds the buffers ({self.max_num_reqs})")
        per_row = np.zeros((ROW_INFO, num_reqs_padded), dtype=np.int64)
        n = layout.num_reqs
        per_row[0, :n], per_row[1, :n], per_row[2, :n] = layout.rows, layout.starts, layout.query_lens
        per_row[3] = spare_index
        if sample_index is not None:
            per_row[3, :n] = sample_index
        if grammar_rows:
            per_row[4, list(grammar_rows)] = np.arange(1, len(grammar_rows) + 1)
        if position_rows:
            per_row[5, list(position_rows)] = position_back
        return upload.put(per_row)

    def prepare(self, table: RequestTable, layout: BatchLayout, seg: tuple[int, int], buf: torch.Tensor,
                num_tokens_padded: int, num_reqs_padded: int, uniform_decode: bool | None = None,
                max_seq_len_bound: int | None = None, before_inputs=None) -> PreparedBatch:
        """Fill the buffers on the device from the table and the flushed upload `buf`. `uniform_decode` and
        `max_seq_len_bound` (a graph's, or None) go into the attention metadata as given. `before_inputs(row_info)`
        may rewrite the rows' starts and sampled-token indices [6, R] on the device before the inputs are read;
        on the CPU the host's sequence lengths are then the device's."""
        num_tokens, num_reqs = layout.num_tokens, layout.num_reqs
        if num_tokens_padded > self.max_num_tokens:
            raise ValueError(f"batch of {num_tokens_padded} tokens exceeds the buffers ({self.max_num_tokens})")
        R, T = num_reqs_padded, num_tokens_padded
        v = self._views(R, T, num_reqs, table.num_groups)
        v.info.copy_(PackedUpload.segment(buf, seg).view(ROW_INFO, R))
        if before_inputs is not None:
            before_inputs(v.info)
        prepare_inputs(v.idx, v.starts, v.qlens, table.token_ids, table.block_tables, table.block_size, num_tokens,
                       v.query_start_loc, v.seq_lens, v.logits_indices_padded, v.input_ids, v.positions,
                       v.slot_mappings, max_num_rows=self.max_num_reqs)
        if table.num_groups == 1:
            torch.index_select(table.block_tables[0], 0, v.idx, out=v.block_tables[0])
        else:   # every group's rows in one gather and one copy, however many groups
            self.block_tables[:, :R].copy_(torch.index_select(table.block_tables, 1, v.idx))
        # host copies of query_start_loc and seq_lens for backends that plan on the host (and the reference)
        ends = layout.starts + layout.query_lens
        qsl_np = np.empty(R + 1, dtype=np.int32)
        qsl_np[0] = 0
        np.cumsum(layout.query_lens, out=qsl_np[1:num_reqs + 1])
        qsl_np[num_reqs + 1:] = num_tokens
        seq_lens_np = np.zeros(R, dtype=np.int32)
        if before_inputs is not None and not v.seq_lens.is_cuda:
            # the device's starts are in host memory: backends that plan on the host read the true lengths (on
            # CUDA `ends` are upper bounds, and only backends that read the device's lengths are allowed)
            ends = (v.starts[:num_reqs] + v.qlens[:num_reqs]).numpy()
        seq_lens_np[:num_reqs] = ends
        common = CommonAttentionMetadata(
            query_start_loc=v.query_start_loc, seq_lens=v.seq_lens,
            query_start_loc_cpu=torch.from_numpy(qsl_np), seq_lens_cpu=torch.from_numpy(seq_lens_np),
            block_tables=v.block_tables, slot_mappings=v.slot_mapping_rows,
            num_reqs=num_reqs, num_actual_tokens=num_tokens, num_reqs_padded=R, num_tokens_padded=T,
            max_query_len=int(layout.query_lens.max()) if num_reqs else 0,
            max_seq_len=int(ends.max()) if num_reqs else 0, num_decodes=layout.num_decodes,
            uniform_decode=(layout.num_decodes == num_reqs) if uniform_decode is None else uniform_decode,
            max_seq_len_bound=max_seq_len_bound)
        tail = self._tail(common) if self.tail_query_start_loc is not None else None
        return PreparedBatch(v.input_ids, v.positions, v.logits_indices, v.idx_live, common, v.sample_index,
                             v.logits_indices_padded, tail, v.mask_index)

    def _views(self, R: int, T: int, num_reqs: int, num_groups: int) -> "_Views":
        """The step's views into the buffers: a handful of shapes repeat (graph buckets), and slicing a tensor
        costs microseconds of host time, so they are made once per shape."""
        key = (R, T, num_reqs)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 4096:    # unbucketed shapes (eager steps) would otherwise grow it forever
                self._view_cache.clear()
            info = self.row_info[:, :R]
            slots = self.slot_mappings[:, :T]
            views = _Views(info=info, idx=info[0], starts=info[1], qlens=info[2], sample_index=info[3],
                           mask_index=info[4], position=info[5], idx_live=info[0, :num_reqs],
                           query_start_loc=self.query_start_loc[:R + 1],
                           seq_lens=self.seq_lens[:R], logits_indices=self.logits_indices[:num_reqs],
                           logits_indices_padded=self.logits_indices[:R], input_ids=self.input_ids[:T],
                           positions=self.positions[:T], slot_mappings=slots,
                           block_tables=tuple(self.block_tables[g, :R] for g in range(num_groups)),
                           slot_mapping_rows=tuple(slots[g] for g in range(num_groups)))
            self._view_cache[key] = views
        return views

    def _tail(self, common: CommonAttentionMetadata) -> CommonAttentionMetadata:
        """`common` with one query per request, its last token (padding requests keep zero-length queries)."""
        num_reqs, R = common.num_reqs, common.num_reqs_padded
        qsl = self.tail_query_start_loc[:R + 1]
        # 0, 1, ..., num_reqs, then num_reqs for the padding rows
        torch.clamp(torch.arange(R + 1, dtype=torch.int32, device=qsl.device), max=num_reqs, out=qsl)
        return dataclasses.replace(
            common, query_start_loc=qsl,
            query_start_loc_cpu=torch.arange(R + 1, dtype=torch.int32).clamp_(max=num_reqs),
            slot_mappings=tuple(self.tail_slot_mappings[g, :R] for g in range(self.tail_slot_mappings.shape[0])),
            num_actual_tokens=num_reqs, num_tokens_padded=R, max_query_len=1 if num_reqs else 0,
            num_decodes=num_reqs, uniform_decode=True)
