"""Speculation under async scheduling: the accepted counts stay on the device, so the next step is launched before
the host knows them.

The request table keeps each row's token count on the device (`RequestTable.device_num_tokens`). A *position row*
(`StepInput.position_rows`: a request whose query starts at its last token) takes its start from that count, not
from the host: `before_inputs` rewrites the row's start and sampled-token index in the step's row info before the
prepare-inputs kernel reads them. A position row of k + 1 query tokens is a verify row: the device n-gram proposer
(`ngram_device`) writes its k proposals into the table after its last token (-1, no proposal, where the history has
none; the query still carries k + 1 tokens, so the batch stays uniform). After verification the emitted tokens'
count advances the device count, the last emitted token goes into the table, and the step's one device-to-host copy
brings every emitted token, the accepted counts and how many proposals were real. The scheduler catches up then
(`Scheduler.update`): it reserved KV for the most a row could need, k + 1 tokens past the most the step before
could emit, and rolls its computed count forward by what was accepted.

Every step of such an engine runs here: steps without a verify row sample as usual (the decode tail of a FULL
graph included, since it reads the rewritten indices) and only advance the counts."""

from __future__ import annotations

import numpy as np
import torch

from ember.graphs.modes import CUDAGraphMode
from ember.profiling import section
from ember.runner.model_runner import PreparedStep
from ember.runner.output import DeviceOnlyOutput
from ember.runner.sampler.sampler import gather_logprobs
from ember.runner.sampling_inputs import plan_sampling, sampling_metadata
from ember.runner.step_input import StepInput
from ember.runner.upload import PackedUpload
from ember.spec_decode.ngram_device import propose_ngram
from ember.spec_decode.rejection import verify
from ember.spec_decode.verify import VerifyOutput, expand
from ember.speculative_config import SpeculativeConfig

# backends that plan attention from the host's sequence lengths: on CUDA the host has only upper bounds of them
HOST_PLANNED_BACKENDS = ("torch_ref", "cpu_sdpa")


class DeviceVerifier:
    """Runs every step of a `ModelRunner` whose engine speculates with async scheduling (proposals made on the
    device: n-gram, or a draft model's)."""
    every_step = True

    def __init__(self, runner, config: SpeculativeConfig):
        if runner.skip_prefill:
            raise ValueError("speculative decoding needs every token's hidden state; this model's KV-sharing "
                             "layers run on the last token only; drop speculative_config for this model")
        check_device_positions(runner)
        self.runner = runner
        self.k = k = config.num_speculative_tokens
        n_min, n_max = config.prompt_lookup_min, config.prompt_lookup_max
        # (token_ids, table rows [V], their counts [V]) -> proposals [V, k], -1 for none; a benchmark may replace it
        self.propose = lambda token_ids, rows, counts: propose_ngram(token_ids, rows, counts, k, n_min, n_max)
        # a draft model's proposer (`draft_device.DeviceDraftProposer`), which then proposes instead, or None
        self.draft = None

    @torch.inference_mode()
    def execute_async(self, step: StepInput):
        r = self.runner
        table, upload, k = r.table, r.upload, self.k
        if step.is_empty:
            raise ValueError("a step needs at least one scheduled request; use update_table for table changes only")
        num_reqs = step.num_reqs
        mode, desc = r._dispatch(step)
        R_pad = desc.padded_num_reqs(num_reqs)
        with section("ember.prepare"):
            upload.begin()
            table.apply(step, upload)
            layout = r._layout(step)
            qlens = layout.query_lens
            ends = layout.starts + qlens
            position = np.zeros(num_reqs, dtype=bool)
            position[list(step.position_rows)] = True
            spare = table.width - 1
            index = np.full(num_reqs, spare, dtype=np.int64)          # position rows: set on the device
            index[~position] = table.sample_index(layout.rows[~position], ends[~position])
            seg = r.input_batch.stage(layout, R_pad, upload, spare, index, step.grammar_rows, step.position_rows)
            plan = plan_sampling(table, layout.rows, ends, upload, len(step.grammar_rows))
            verify_rows = np.flatnonzero(position & (qlens == k + 1)) if step.device_drafts else np.zeros(0, int)
            S = k + 1 if verify_rows.size else 1
            d = np.zeros(num_reqs, dtype=np.int64)
            d[verify_rows] = k
            last = np.cumsum(qlens) - 1
            logit_rows = (last - d)[:, None] + np.minimum(np.arange(S)[None, :], d[:, None])       # [R, S]
            host_seg = upload.put(np.concatenate([verify_rows.astype(np.int64), d, logit_rows.reshape(-1)]))
            buf = upload.flush()
            table.commit(buf)
            dev = PackedUpload.segment(buf, host_seg)
            V = verify_rows.size
            verify_rows_d, d_d, logit_rows_d = dev[:V], dev[V:V + num_reqs], dev[V + num_reqs:]
            drafts = {}
            # the draft model runs its steps here, from the table's tokens and counts on the device
            drafted = self.draft.propose(step, verify_rows, layout.rows, table) if self.draft is not None else None

            def before_inputs(info: torch.Tensor) -> None:
                idx = info[0]
                count = position_inputs(table, info)                                  # [R_pad]
                if V:
                    rows, counts = idx[verify_rows_d], count[verify_rows_d]
                    proposals = (drafted if drafted is not None
                                 else self.propose(table.token_ids, rows, counts))              # [V, k]
                    at = rows[:, None] * table.width + counts[:, None] + torch.arange(k, device=idx.device)
                    # a missing proposal still runs as a query token (token 0); the verify step never accepts it
                    table.token_ids.view(-1).index_copy_(0, at.reshape(-1),
                                                         proposals.clamp(min=0).reshape(-1).to(torch.int32))
                    drafts["proposals"] = proposals

            batch = r.input_batch.prepare(table, layout, seg, buf, desc.num_tokens, R_pad,
                                          *r._graph_batch(desc, mode == CUDAGraphMode.FULL),
                                          before_inputs=before_inputs)
        prepared = PreparedStep(batch, mode, desc, plan, buf)
        if not V:
            out = r.sample_step(prepared, *r.forward(prepared))
            self._advance(batch.idx_mapping, batch.sample_index[:num_reqs])
            return out
        with section("ember.forward"):
            hidden = r._run(batch, mode, desc)[0]
        with section("ember.sample"):
            # verification needs whole rows: the logits gathered under tensor parallelism
            r.decode_tail.count(False)
            logits = r.model.compute_logits(hidden[logit_rows_d])                    # [R * S, V]
            meta = sampling_metadata(table, plan, batch.idx_mapping, batch.common.seq_lens[:num_reqs], buf)
            counters = (meta.output_lens - d_d)[:, None] + torch.arange(S, device=r.device)[None, :]
            meta = expand(meta, S, counters.reshape(-1))
            draft = torch.full((num_reqs, S), -1, dtype=torch.int64, device=r.device)
            draft[verify_rows_d, :k] = drafts["proposals"]
            tokens, num_accepted = verify(logits, meta, draft, S)
            final = tokens.gather(1, num_accepted[:, None])[:, 0]
            index_d = batch.sample_index[:num_reqs] + num_accepted   # after the accepted proposals
            table.write_sampled(index_d, final)
            self._advance(batch.idx_mapping, index_d)
            if not r.tp.is_driver:      # every rank wrote the same tokens and counts into its table; rank 0 reports
                return DeviceOnlyOutput()
            proposed = (draft >= 0).sum(dim=1)
            logprobs = None
            if meta.max_num_logprobs is not None:
                raw = torch.log_softmax(logits.float(), dim=-1)
                logprobs = gather_logprobs(raw, tokens.reshape(-1), meta.max_num_logprobs)
        with section("ember.to_host"):
            # the host's token counts of these rows are not kept (the device's are): no mirror to advance
            return VerifyOutput(tokens, num_accepted, logprobs, r.device, table, layout.rows, np.zeros(num_reqs),
                                proposed=proposed)

    def _advance(self, idx: torch.Tensor, sample_index: torch.Tensor) -> None:
        advance_counts(self.runner.table, idx, sample_index)


def check_device_positions(runner) -> None:
    """Refuse, on CUDA, attention backends that plan on the host's sequence lengths: position rows' lengths are
    known only on the device."""
    if runner.device.type != "cpu":
        planned = sorted({b.name for b in runner.attn.backends} & set(HOST_PLANNED_BACKENDS))
        if planned:
            raise ValueError(f"attention backend {planned[0]!r} plans on the host's sequence lengths, which "
                             f"async speculation knows only on the device; pass async_scheduling=False or "
                             f"use another attention backend")


def position_inputs(table, info: torch.Tensor) -> torch.Tensor:
    """Rewrite the position rows of a step's row info [6, R] on the device: a row flagged n > 0 starts n tokens
    before its device token count and samples into the column after it. Returns every row's count [R]."""
    idx, starts, sample_index, back = info[0], info[1], info[3], info[5]
    count = table.device_num_tokens[idx]                                                      # [R]
    flag = back > 0
    starts.copy_(torch.where(flag, count - back, starts))
    sample_index.copy_(torch.where(flag, idx * table.width + count, sample_index))
    return count


def advance_counts(table, idx: torch.Tensor, sample_index: torch.Tensor) -> None:
    """Each batch row that sampled holds its tokens up to the one it sampled: set its device count there."""
    position = sample_index - idx * table.width
    counts = table.device_num_tokens[idx]
    table.device_num_tokens.index_copy_(0, idx, torch.where(position != table.width - 1, position + 1, counts))
