"""`RequestTable`: the runner's persistent record of every running request, one row each, in device tensors
allocated once, with host mirrors of what the host needs to decide a step (counts, sampling flags).

The scheduler's `StepInput` changes the table by deltas only: a new request writes its row once (tokens, blocks,
sampling parameters); a running one appends the blocks it gained; a finished one frees its row. The device side
of these writes is staged in the step's `PackedUpload` and scattered after its one copy (`commit`).

Sampled tokens never come back through the host: the step writes them into the table's token ids on the device
(`write_sampled`), where the next step's prepare-inputs kernel reads them. So a request whose last token is still
in flight needs nothing from the engine, and penalties read every output token from the table.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ember.runner.step_input import NewRequest, StepInput
from ember.runner.upload import PackedUpload

# the most token-id writes, and block-id writes, a step's upload carries: more go ahead in pieces of this many
# (`_send_pieces`), so the upload needs `upload_elements()` more than the batch's own data and never grows. One
# request of 131,072 tokens fits in one piece; 2 MiB of int64 indices and as much of values each.
WRITE_PIECE = 1 << 17

# columns of the float and int parameter tables
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY, GREEDY = range(7)
TOP_K, SEED, NUM_PROMPT = range(3)


@dataclass
class _Writes:
    """One step's device writes, as segments of the packed upload."""
    token_index: tuple[int, int] | None = None     # flat indices into token_ids
    token_values: tuple[int, int] | None = None
    block_index: tuple[int, int] | None = None     # flat indices into block_tables
    block_values: tuple[int, int] | None = None
    param_rows: tuple[int, int] | None = None
    params_f: tuple[int, int] | None = None        # [n, 7] float (as float64 bits)
    params_i: tuple[int, int] | None = None        # [n, 3] int
    num_tokens: tuple[int, int] | None = None      # [n] the new rows' token counts


class RequestTable:
    """Rows of running requests: token ids, block rows per KV-cache group, sampling parameters."""

    def __init__(self, num_groups: int, block_size: int, max_num_reqs: int, max_model_len: int, vocab_size: int,
                 device: torch.device, write_piece: int = WRITE_PIECE):
        self.num_groups, self.block_size, self.max_num_reqs = num_groups, block_size, max_num_reqs
        self.max_model_len, self.vocab_size, self.device = max_model_len, vocab_size, device
        self.write_piece = write_piece
        # one spare column: rows that do not sample this step write their (discarded) token there
        self.width = max_model_len + 1
        self.max_blocks = -(-max_model_len // block_size)
        self.token_ids = torch.zeros(max_num_reqs, self.width, dtype=torch.int32, device=device)    # [R, L + 1]
        self.block_tables = torch.zeros(num_groups, max_num_reqs, self.max_blocks, dtype=torch.int32,
                                        device=device)                                             # [G, R, B]
        self.params_f = torch.ones(max_num_reqs, 7, dtype=torch.float32, device=device)             # [R, 7]
        self.params_i = torch.zeros(max_num_reqs, 3, dtype=torch.int64, device=device)              # [R, 3]
        # tokens each row holds as the device counts them, set when a row arrives; only async speculation, whose
        # accepted counts stay on the device, advances it (`ember.spec_decode.device_verify`)
        self.device_num_tokens = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)        # [R]
        # host mirrors
        self.params_f_np = np.ones((max_num_reqs, 7), dtype=np.float32)
        self.params_i_np = np.zeros((max_num_reqs, 3), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)       # tokens the row holds, sampled ones included
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.logprobs = np.full(max_num_reqs, -1, dtype=np.int64)       # -1: none asked
        self.stop_ids: list[tuple[int, ...]] = [()] * max_num_reqs     # blocked while under min_tokens
        self.rows: dict[str, int] = {}
        # requests whose host count a verify step left unknown (a tensor-parallel rank other than 0 reads no tokens
        # back): the next step that schedules one sets it from the scheduler's count (`_settle`)
        self.unsettled: set[str] = set()
        self.version = 0        # counts row arrivals and exits: equal versions mean the same request in every row
        self.plan_cache = None  # (version, rows, plan) of the last sampling plan that stays valid while they do
        self._free = list(range(max_num_reqs))                          # a heap: the lowest free row first
        self._writes = _Writes()

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def upload_elements(self) -> int:
        """The int64 elements the table's writes take in one step's upload at most: a piece of token ids and one
        of block ids, each an index and a value per entry, aligned."""
        return 4 * (self.write_piece + 1)

    # ---- host side: deltas into the upload ---------------------------------------------------------------------
    def apply(self, step: StepInput, upload: PackedUpload) -> None:
        """Drop finished rows, add new ones, extend running ones; stage the device writes in `upload` (call it
        first in a step, right after `upload.begin()`: writes beyond a piece are sent ahead, `_send_pieces`)."""
        for req_id in step.finished_ids:
            self.remove(req_id)
        token_index, token_values, block_index, block_values = [], [], [], []
        new_rows = []
        for new in step.new_requests:
            row = self._add(new, token_index, token_values, block_index, block_values)
            new_rows.append((row, new))
        if self.unsettled:
            self._settle(step)
        rows = self.rows
        for run in step.running_requests:
            row = rows.get(run.req_id)
            if row is None:
                raise ValueError(f"request {run.req_id!r} gained blocks but has no row in the table; a request "
                                 f"must arrive as a NewRequest first")
            for g, blocks in enumerate(run.new_block_ids):
                if blocks:
                    self._stage_blocks(g, row, blocks, block_index, block_values)
        if step.spec_token_ids:     # proposals follow each such request's tokens (read by the verify step)
            for req_id, drafts in zip(step.req_ids, step.spec_token_ids):
                if drafts:
                    row = rows[req_id]
                    token_index.append(row * self.width + self.num_tokens[row] + np.arange(len(drafts)))
                    token_values.append(np.asarray(drafts, dtype=np.int64))
        w = _Writes()
        # every full piece goes ahead in an upload of its own, before anything else is put in this step's
        tokens = self._send_pieces(upload, token_index, token_values, self.token_ids)
        blocks = self._send_pieces(upload, block_index, block_values, self.block_tables)
        if tokens is not None:
            w.token_index, w.token_values = upload.put(tokens[0]), upload.put(tokens[1])
        if blocks is not None:
            w.block_index, w.block_values = upload.put(blocks[0]), upload.put(blocks[1])
        if new_rows:
            rows = np.array([r for r, _ in new_rows], dtype=np.int64)
            w.param_rows = upload.put(rows)
            w.params_f = upload.put(self.params_f_np[rows])
            w.params_i = upload.put(self.params_i_np[rows])
            w.num_tokens = upload.put(self.num_tokens[rows])
        self._writes = w

    def _settle(self, step: StepInput) -> None:
        """Set the host count of each unsettled request this step schedules: after a synchronous verify step the
        scheduler has appended every emitted token and counts all but the last as computed, so the row holds its
        computed count plus one (what rank 0 sets from the tokens it read back)."""
        for req_id, computed in zip(step.req_ids, step.num_computed_tokens):
            if req_id in self.unsettled:
                self.num_tokens[self.rows[req_id]] = computed + 1
                self.unsettled.discard(req_id)

    def _send_pieces(self, upload: PackedUpload, index: list, values: list, target: torch.Tensor
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """Write all but the last `write_piece` of these (flat index, value) pairs into `target` now, a piece at a
        time, each piece its own upload and scatter; returns the rest (None if there is none) for the step's own
        upload. A step that adds many long requests at once (256 prefix-cache hits of 131,072 tokens: 33 million
        token ids) so never stages more than a piece on the device, and the upload keeps the size it had."""
        if not index:
            return None
        index, values = np.concatenate(index), np.concatenate(values)
        piece = self.write_piece
        start = 0
        while len(index) - start > piece:
            end = start + piece
            index_seg, value_seg = upload.put(index[start:end]), upload.put(values[start:end])
            buf = upload.flush()
            seg = PackedUpload.segment
            target.view(-1).index_copy_(0, seg(buf, index_seg), seg(buf, value_seg).to(torch.int32))
            upload.begin()
            start = end
        return index[start:], values[start:]

    def _add(self, new: NewRequest, token_index, token_values, block_index, block_values) -> int:
        if new.req_id in self.rows:
            raise ValueError(f"request {new.req_id!r} already has a row in the table")
        if not self._free:
            raise ValueError(f"the request table is full ({self.max_num_reqs} rows); no room for {new.req_id!r}")
        n = new.num_tokens
        if n > self.max_model_len:
            raise ValueError(f"request {new.req_id!r} has {n} tokens, more than max_model_len {self.max_model_len}")
        p, V = new.sampling_params, self.vocab_size
        stop = tuple(new.eos_token_ids) + tuple(p.stop_token_ids) if p.min_tokens > 0 else ()
        bad = [t for t in stop if not 0 <= t < V]
        if bad:
            raise ValueError(f"stop/eos token id {bad[0]} is outside the vocabulary of size {V}")
        if not 0 <= new.seed < 2**63:
            raise ValueError(f"seed {new.seed} must be in [0, 2**63)")
        row = heapq.heappop(self._free)
        self.rows[new.req_id] = row
        self.unsettled.discard(new.req_id)
        self.version += 1
        # fromiter reads Python ints faster than asarray does, and no joined tuple is built first
        tokens = np.fromiter(new.prompt_token_ids, dtype=np.int64, count=len(new.prompt_token_ids))
        if new.output_token_ids:    # a preempted request's generated tokens follow its prompt
            tokens = np.concatenate((tokens, np.fromiter(new.output_token_ids, dtype=np.int64)))
        token_index.append(row * self.width + np.arange(n, dtype=np.int64))
        token_values.append(tokens)
        self.num_tokens[row] = n
        self.num_blocks[:, row] = 0
        for g, blocks in enumerate(new.block_ids):
            if blocks:
                self._stage_blocks(g, row, blocks, block_index, block_values)
        greedy = p.temperature == 0.0
        # greedy rows hold neutral values: their random draw is computed but discarded
        self.params_f_np[row] = (1.0 if greedy else p.temperature, 1.0 if greedy else p.top_p,
                                 0.0 if greedy else p.min_p, p.repetition_penalty, p.presence_penalty,
                                 p.frequency_penalty, 1.0 if greedy else 0.0)
        top_k = V if greedy or p.top_k < 0 or p.top_k >= V else p.top_k
        self.params_i_np[row] = (top_k, new.seed, len(new.prompt_token_ids))
        self.min_tokens[row] = p.min_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.stop_ids[row] = stop
        return row

    def _stage_blocks(self, g: int, row: int, blocks, block_index, block_values) -> None:
        start = int(self.num_blocks[g, row])
        n = len(blocks)
        if start + n > self.max_blocks:
            raise ValueError(f"row {row} would hold {start + n} blocks in group {g}, more than {self.max_blocks}")
        base = (g * self.max_num_reqs + row) * self.max_blocks + start
        block_index.append(base + np.arange(n, dtype=np.int64))
        block_values.append(np.fromiter(blocks, dtype=np.int64, count=n))
        self.num_blocks[g, row] = start + n

    def remove(self, req_id: str) -> bool:
        """Free a request's row (no device work: the row is overwritten when reused). Returns whether it had one."""
        row = self.rows.pop(req_id, None)
        self.unsettled.discard(req_id)
        if row is None:
            return False
        heapq.heappush(self._free, row)
        self.version += 1
        return True

    def rows_of(self, req_ids) -> np.ndarray:
        """Table rows of the batch's requests, in batch order."""
        rows = self.rows
        try:
            return np.fromiter(map(rows.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        except KeyError as exc:
            raise ValueError(f"request {exc.args[0]!r} is in the batch but has no row in the table") from None

    def sample_index(self, rows: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Flat token_ids index of each batch row's sampled token, and count the tokens: a row samples when its
        chunk reaches the end of its tokens (`ends`), and the token lands at position `ends`; a row part-way
        through its prompt samples a token nobody reads, into its spare column."""
        samples = ends == self.num_tokens[rows]
        self.num_tokens[rows[samples]] += 1
        return rows * self.width + np.where(samples, ends, self.width - 1)

    # ---- device side ---------------------------------------------------------------------------------------------
    def commit(self, buf: torch.Tensor) -> None:
        """Scatter the staged writes from the flushed upload into the device tables."""
        w, seg = self._writes, PackedUpload.segment
        if w.token_index is not None:
            self.token_ids.view(-1).index_copy_(0, seg(buf, w.token_index),
                                                seg(buf, w.token_values).to(torch.int32))
        if w.block_index is not None:
            self.block_tables.view(-1).index_copy_(0, seg(buf, w.block_index),
                                                   seg(buf, w.block_values).to(torch.int32))
        if w.param_rows is not None:
            rows = seg(buf, w.param_rows)
            self.params_f.index_copy_(0, rows, seg(buf, w.params_f, torch.float32).view(-1, 7))
            self.params_i.index_copy_(0, rows, seg(buf, w.params_i).view(-1, 3))
            self.device_num_tokens.index_copy_(0, rows, seg(buf, w.num_tokens))
        self._writes = _Writes()

    def write_sampled(self, sample_index: torch.Tensor, sampled: torch.Tensor) -> None:
        """Put each batch row's sampled token at its flat index in token_ids (a spare column for rows that were
        only part-way through their prompt)."""
        self.token_ids.view(-1).index_copy_(0, sample_index, sampled.to(torch.int32))
