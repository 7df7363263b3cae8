"""The verify step: each request runs its last token and its proposals (k + 1 query tokens, a short prefill), the
target's logits at every one of them are verified by `rejection.verify`, the last emitted token goes into the
request table on the device, and one device-to-host copy brings back every emitted token (and logprobs).

The proposals reach the table's token ids through the step's upload (`RequestTable.apply`), so the prepare-inputs
kernel reads them like any token; their KV is written by the forward, and the KV of rejected ones is overwritten
by later steps. The host's token count of a request grows by what it emitted once the copy has landed."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ember.profiling import section
from ember.runner.output import DeviceOnlyOutput, ModelRunnerOutput
from ember.runner.sampler import SamplingMetadata
from ember.runner.sampler.sampler import gather_logprobs
from ember.runner.sampling_inputs import sampling_metadata
from ember.runner.step_input import StepInput
from ember.spec_decode.rejection import verify


def make_verifier(runner, config):
    """The runner's verifier: none without speculation; with async scheduling (n-gram proposals made on the
    device) a `DeviceVerifier`, which runs every step; else a `Verifier`, for the steps that carry proposals."""
    spec = config.speculative
    if spec is None:
        return None
    if config.scheduler.async_scheduling:
        from ember.spec_decode.device_verify import DeviceVerifier
        return DeviceVerifier(runner, spec)
    return Verifier(runner)


class Verifier:
    """Runs the steps that carry proposals on a `ModelRunner` (its table, buffers, forward and graphs)."""

    every_step = False      # it runs the steps that carry proposals; the others are the runner's own

    def __init__(self, runner):
        if runner.skip_prefill:
            raise ValueError("speculative decoding needs every token's hidden state; this model's KV-sharing "
                             "layers run on the last token only; drop speculative_config for this model")
        self.runner = runner

    def execute_async(self, step: StepInput) -> "VerifyOutput":
        r = self.runner
        table = r.table
        prepared = r.prepare_step(step)
        batch = prepared.batch
        rows = table.rows_of(step.req_ids)
        R = len(rows)
        d = np.fromiter(map(len, step.spec_token_ids), dtype=np.int64, count=R)
        S = int(d.max()) + 1
        qlens = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
        ends = np.asarray(step.num_computed_tokens, dtype=np.int64) + qlens
        last = np.cumsum(qlens) - 1                                       # each request's last query token
        slots = np.arange(S)
        logit_rows = (last - d)[:, None] + np.minimum(slots[None, :], d[:, None])     # [R, S]
        draft = np.full((R, S), -1, dtype=np.int64)
        for i in np.flatnonzero(d):
            draft[i, :d[i]] = step.spec_token_ids[i]
        # where each request's last emitted token goes: after its accepted proposals (-1: the plain sample index)
        base = np.where(d > 0, rows * table.width + ends - d, -1)
        host = np.concatenate([logit_rows.reshape(-1), draft.reshape(-1), base, d])
        dev = torch.from_numpy(host).to(r.device, non_blocking=True)
        logit_rows_d, draft_d = dev[:R * S], dev[R * S:2 * R * S].view(R, S)
        base_d, d_d = dev[2 * R * S:2 * R * S + R], dev[2 * R * S + R:]
        with section("ember.forward"):
            hidden = r._run(batch, prepared.mode, prepared.desc)[0]
        with section("ember.sample"):
            # verification needs whole rows: the logits gathered under tensor parallelism
            r.decode_tail.count(False)
            logits = r.model.compute_logits(hidden[logit_rows_d])                    # [R * S, V]
            meta = sampling_metadata(table, prepared.plan, batch.idx_mapping, batch.common.seq_lens[:R], prepared.buf)
            counters = (meta.output_lens - d_d)[:, None] + torch.arange(S, device=r.device)[None, :]
            meta = expand(meta, S, counters.reshape(-1))
            tokens, num_accepted = verify(logits, meta, draft_d, S)
            final = tokens.gather(1, num_accepted[:, None])[:, 0]
            index = torch.where(base_d >= 0, base_d + num_accepted, batch.sample_index[:R])
            table.write_sampled(index, final)
            if not r.tp.is_driver:
                # the same tokens are in every rank's table; rank 0 alone reads them back, so this rank's host counts
                # of these rows are set from the next step that schedules them (`RequestTable.unsettled`)
                table.unsettled.update(step.req_ids[i] for i in np.flatnonzero(d))
                return DeviceOnlyOutput()
            logprobs = None
            if meta.max_num_logprobs is not None:
                raw = torch.log_softmax(logits.float(), dim=-1)
                logprobs = gather_logprobs(raw, tokens.reshape(-1), meta.max_num_logprobs)
        with section("ember.to_host"):
            return VerifyOutput(tokens, num_accepted, logprobs, r.device, table, rows, d)


def expand(meta: SamplingMetadata, num_slots: int, counters: torch.Tensor) -> SamplingMetadata:
    """`meta` of R requests as R * num_slots rows (each request's row repeated), with the noise counters given."""
    R = meta.num_reqs
    rep = torch.arange(R, device=counters.device).repeat_interleave(num_slots)
    fields = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        if isinstance(v, torch.Tensor) and v.shape[:1] == (R,):
            fields[f.name] = v[rep]
    fields.update(num_reqs=R * num_slots, output_lens=counters)
    return dataclasses.replace(meta, **fields)


class VerifyOutput:
    """A verify step's emitted tokens on their way to the host (one copy); `result()` waits, and advances the
    host's token count of each request that had proposals by the tokens it emitted. `proposed` [R]: how many of
    each row's proposals were real (proposals made on the device), reported in `num_proposed`."""

    def __init__(self, tokens, num_accepted, logprobs, device, table, rows, d, proposed=None):
        R, S = tokens.shape
        parts = [tokens.double(), num_accepted[:, None].double()]
        self._proposed = proposed is not None
        if self._proposed:
            parts.append(proposed[:, None].double())
        self._k = None
        if logprobs is not None:
            ids, lps, ranks = logprobs
            self._k = ids.shape[1]
            parts += [ids.view(R, -1).double(), lps.view(R, -1).double(), ranks.view(R, S).double()]
        packed = torch.cat(parts, dim=1)
        self._event = None
        if device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event(blocking=True)
            self._event.record()
            packed = host
        self._packed, self._S, self._table, self._rows, self._d = packed, S, table, rows, d

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            with section("ember.wait"):
                self._event.synchronize()
        p, S, k = self._packed.numpy(), self._S, self._k
        tokens = p[:, :S].astype(np.int64)
        accepted = p[:, S].astype(np.int64)
        spec = self._d > 0
        self._table.num_tokens[self._rows[spec]] += accepted[spec] + 1
        first = tokens[:, 0].tolist()
        extra = [tokens[i, 1:a + 1].tolist() for i, a in enumerate(accepted.tolist())]
        o = S + 1
        proposed = None
        if self._proposed:
            proposed, o = p[:, o].astype(np.int64).tolist(), o + 1
        if k is None:
            return ModelRunnerOutput(first, spec_token_ids=extra, logprob_stride=S, num_proposed=proposed)
        ids = p[:, o:o + S * k].reshape(-1, k).astype(np.int64).tolist()
        lps = p[:, o + S * k:o + 2 * S * k].reshape(-1, k).tolist()
        ranks = p[:, o + 2 * S * k:].reshape(-1).astype(np.int64).tolist()
        return ModelRunnerOutput(first, ids, lps, ranks, spec_token_ids=extra, logprob_stride=S, num_proposed=proposed)
