"""The draft model under async scheduling: its k greedy steps take their inputs from the target's request table on
the device (the tokens the last verify step emitted and the device's token counts), and their proposals go where
the verify step reads them, so the host never waits between the target's verify step and the draft's steps.

The draft keeps a row of its own table per request it proposes for. Each step, for every verify row (a position
row of k + 1 tokens, `device_verify`), the draft runs:

1. a *window*: the row's last two tokens as a query, starting two tokens before the target's device token count,
   copied from the target's table on the device. The step before emitted one token after a rejection, two (the
   last proposal and the bonus token) after a whole run was accepted; the draft's cache holds the tokens before
   them (the proposals it ran itself and the target accepted), so two tokens always catch it up, whichever it was.
   The window samples the first proposal after the last token;
2. k - 1 single-token decode steps (the draft runner's FULL decode graphs on CUDA), each sampling the next
   proposal into the draft's table after its device count, then advancing it;
3. a gather of the k proposals, which the verify step writes into the target's table after the last token.

A request the draft did not run a window for in the target's last step with it (a new request, a prefill chunk, a
1-token row: its proposals dropped for the step's budget, `disable_by_batch_size`, penalties) has lost the draft's
continuity. Its next verify row comes right after a step that could emit only one token for it, so the host knows
its count exactly (the scheduler's upper bound): the draft then copies its tokens from the target's table and
prefills the ones its cache misses (host-known positions, chunked to the draft's token budget) before the window.

The draft's cache blocks come from a pool of its own; the scheduler reserves them (`reserve`) for the most a row
can reach, as it does the target's, and `drop` frees them when a request leaves. Rejected proposals' KV is
overwritten by later windows, as the target's is."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ember.graphs.modes import CUDAGraphMode
from ember.runner.step_input import NewRequest, RunningRequest, StepInput
from ember.runner.upload import PackedUpload
from ember.spec_decode.device_verify import advance_counts, check_device_positions, position_inputs
from ember.spec_decode.draft_model import _GREEDY, check_groups

_WINDOW = 2     # query tokens of a window: the step before emitted 1 or 2 tokens the draft's cache lacks


@dataclass
class _State:
    """The draft's view of one request: its blocks (those its table row holds: `sent`), the tokens whose KV its
    cache surely holds (`done`, a lower bound the host knows) and whether the draft ran a window for it in the
    target's last step with it (`synced`)."""
    blocks: list[int] = field(default_factory=list)
    sent: int = 0
    in_table: bool = False
    done: int = 0
    synced: bool = False


class DeviceDraftProposer:
    """Proposes for the verify rows of each step of a `DeviceVerifier` (`propose`, called by it); the scheduler
    reserves cache blocks for a row before giving it k + 1 tokens (`reserve`) and calls `drop` when a request
    leaves."""

    def __init__(self, runner, num_speculative_tokens: int):
        check_groups(runner)
        check_device_positions(runner)
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_size = runner.config.cache.block_size
        # the draft uploads k times a step and more (catch-ups, new rows): its ring of pinned staging buffers
        # grows to hold two steps' uploads rather than wait for copies queued behind the step in flight
        runner.upload.max_depth = 4 * (self.k + 2)
        self._free = list(range(runner.num_blocks - 1, 0, -1))     # block 0 is the null block
        self._states: dict[str, _State] = {}
        self._gone: list[str] = []          # requests whose rows leave the draft's table at its next change

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def reserve(self, req_id: str, num_tokens: int) -> bool:
        """Hold blocks for `num_tokens` of the request's tokens in the draft's cache; False if the pool is short
        (the request gets no proposals this step)."""
        state = self._states.setdefault(req_id, _State())
        need = -(-num_tokens // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return False
        state.blocks.extend(self._free.pop() for _ in range(max(need, 0)))
        return True

    def drop(self, req_id: str) -> None:
        """Forget a request: its blocks go back to the pool, its row leaves the draft's table."""
        state = self._states.pop(req_id, None)
        if state is not None:
            self._free.extend(state.blocks)
            if state.in_table:
                self._gone.append(req_id)

    @torch.inference_mode()
    def propose(self, step: StepInput, verify_rows: np.ndarray, rows: np.ndarray, target) -> torch.Tensor | None:
        """The proposals [V, k] for the step's verify rows `verify_rows` (batch indices; `rows`: the batch's rows
        of the target's table `target`), launched on the device; None when the step has none."""
        ids = [step.req_ids[i] for i in verify_rows]
        chosen = set(ids)
        for req_id in step.req_ids:
            state = self._states.get(req_id)
            if state is not None and req_id not in chosen:
                state.synced = False
        if not ids:
            return None
        states = []
        for req_id in ids:
            state = self._states.get(req_id)
            if state is None or not state.blocks:
                raise RuntimeError(f"request {req_id!r} is a verify row without draft blocks; the scheduler reserves "
                                   f"them (DeviceDraftProposer.reserve) before it gives a row k + 1 tokens")
            states.append(state)
        ub = np.array([step.num_computed_tokens[i] + 1 for i in verify_rows], dtype=np.int64)   # counts, at most
        self._update_rows(ids, states)
        draft = self.runner.table
        drows, trows = draft.rows_of(ids), rows[verify_rows]
        jobs = []
        for i, state in enumerate(states):
            if not state.synced:     # its count is exact (`ub`): copy what the draft's cache misses, prefill it
                lo, count = state.done, int(ub[i])
                draft.token_ids[drows[i], lo:count].copy_(target.token_ids[trows[i], lo:count])
                if count - _WINDOW > lo:
                    jobs.append((ids[i], lo, count - _WINDOW))
                state.done = count
            else:
                # the window starts at the count less 2, and the count is at least `ub` - k (the step before
                # emitted at most k + 1 tokens): the cache holds at least that much
                state.done = max(state.done, int(ub[i]) - self.k)
            state.synced = True
        self._prefill(jobs)
        V = len(ids)
        counts = self._launch(StepInput(req_ids=tuple(ids), num_scheduled_tokens=(_WINDOW,) * V,
                                        num_computed_tokens=tuple((ub - _WINDOW).tolist())),
                              _WINDOW, trows, target)
        drows_d = self._rows
        for j in range(1, self.k):
            self._launch(StepInput(req_ids=tuple(ids), num_scheduled_tokens=(1,) * V, num_decodes=V,
                                   num_computed_tokens=tuple((ub - 1 + j).tolist())), 1)
        positions = counts[:, None] + torch.arange(self.k, device=counts.device)                   # [V, k]
        return draft.token_ids[drows_d[:, None], positions].to(torch.int64)

    def _update_rows(self, ids: list[str], states: list[_State]) -> None:
        """Rows for requests new to the draft's table, the blocks reserved since, and rows of requests gone."""
        new, running = [], []
        for req_id, state in zip(ids, states):
            if not state.in_table:
                # a placeholder token: the windows and catch-ups copy the request's tokens from the target's table
                new.append(NewRequest(req_id, (0,), _GREEDY, 0, (tuple(state.blocks),), 0))
                state.in_table = True
            elif len(state.blocks) > state.sent:
                running.append(RunningRequest(req_id, (tuple(state.blocks[state.sent:]),)))
            state.sent = len(state.blocks)
        if new or running or self._gone:
            self.runner.update_table(StepInput(new_requests=tuple(new), running_requests=tuple(running),
                                               finished_ids=tuple(self._gone)))
            self._gone.clear()

    def _prefill(self, jobs: list[tuple[str, int, int]]) -> None:
        """Run the tokens [start, end) of each (request, start, end) through the draft, in steps of at most its
        token budget and its rows; they sample nothing."""
        runner = self.runner
        pending = list(jobs)
        while pending:
            budget, batch, rest = runner.max_num_tokens, [], []
            for req_id, start, end in pending:
                n = min(end - start, budget)
                if n < 1 or len(batch) == runner.max_num_reqs:
                    rest.append((req_id, start, end))
                    continue
                batch.append((req_id, start, n))
                budget -= n
                if start + n < end:
                    rest.append((req_id, start + n, end))
            batch.sort(key=lambda b: b[2] != 1)     # single-token queries lead the batch
            self._launch(StepInput(req_ids=tuple(b[0] for b in batch), num_scheduled_tokens=tuple(b[2] for b in batch),
                                   num_decodes=sum(1 for b in batch if b[2] == 1),
                                   num_computed_tokens=tuple(b[1] for b in batch)), 0)
            pending = rest

    def _launch(self, step: StepInput, back: int, trows: np.ndarray | None = None, target=None):
        """Launch one draft step. `back` > 0: every row starts `back` tokens before its device count and samples
        its greedy token after it, which advances the count; with `target`, the counts and the window's tokens
        are first taken from the target's table rows `trows` (returns those counts [V]). `back` 0: the rows start
        where the step says and sample nothing."""
        r = self.runner
        table, upload = r.table, r.upload
        n = step.num_reqs
        mode, desc = r._dispatch(step)
        R_pad = desc.padded_num_reqs(n)
        upload.begin()
        table.apply(step, upload)
        layout = r._layout(step)
        seg = r.input_batch.stage(layout, R_pad, upload, table.width - 1, None, (),
                                  tuple(range(n)) if back else (), back)
        trows_seg = upload.put(trows) if target is not None else None
        buf = upload.flush()
        table.commit(buf)
        taken = {}

        def before_inputs(info: torch.Tensor) -> None:
            if target is not None:
                idx, trows_d = info[0, :n], PackedUpload.segment(buf, trows_seg)
                counts = target.device_num_tokens[trows_d]                                    # [V]
                at = counts[:, None] - _WINDOW + torch.arange(_WINDOW, device=counts.device)   # [V, 2]
                table.token_ids[idx[:, None], at] = target.token_ids[trows_d[:, None], at]
                table.device_num_tokens[idx] = counts
                taken["counts"], self._rows = counts, idx.clone()
            if back:
                position_inputs(table, info)

        batch = r.input_batch.prepare(table, layout, seg, buf, desc.num_tokens, R_pad,
                                      *r._graph_batch(desc, mode == CUDAGraphMode.FULL), before_inputs=before_inputs)
        hidden, tokens = r._run(batch, mode, desc)
        if back:
            sample_index = batch.sample_index[:n]
            if tokens is None:      # a decode graph's tail samples the greedy rows in place
                logits = r.model.compute_logits(r._logits_hidden(batch, hidden))
                table.write_sampled(sample_index, logits.argmax(dim=-1))
            advance_counts(table, batch.idx_mapping, sample_index)
        return taken.get("counts")
