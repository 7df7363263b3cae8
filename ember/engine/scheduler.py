"""Continuous batching under a token budget: running requests first (decodes and unfinished chunked prefills),
then new requests, prefill chunked to fit. When blocks run out, the newest running request is preempted
by recompute and put back at the head of the queue: it is never dropped."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ember.config import SchedulerConfig
from ember.engine.kv_manager import KVCacheCoordinator
from ember.engine.prompt_fork import PromptFork
from ember.engine.request import Request, RequestStatus
from ember.runner.step_input import NewRequest, RunningRequest, StepInput
from ember.spec_decode.ngram import NgramProposer
from ember.spec_decode.schedule import proposal_limit, propose_for
from ember.speculative_config import SpeculativeConfig


class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, num_computed_tokens + num_new_tokens).
    `samples`: whether the step reaches the end of the request's tokens (a token still in flight counts), so that
    its logits give the next token; fixed when the step is scheduled."""
    __slots__ = ("request", "num_computed_tokens", "num_new_tokens", "samples", "spec_token_ids", "device_drafts")

    def __init__(self, request: Request, num_computed_tokens: int, num_new_tokens: int, samples: bool,
                 spec_token_ids: tuple[int, ...] = (), device_drafts: int | None = None):
        self.request = request
        self.num_computed_tokens = num_computed_tokens
        self.num_new_tokens = num_new_tokens
        self.samples = samples
        self.spec_token_ids = spec_token_ids     # proposals after the last token (its query's other tokens)
        # a position row (async speculation): its query starts at its last token wherever the device has it
        # (num_computed_tokens is the latest that can be), with this many proposals made on the device; else None
        self.device_drafts = device_drafts

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.request.request_id!r}, {self.num_computed_tokens}, {self.num_new_tokens}, "
                f"samples={self.samples})")


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch: decodes (single-token queries) first, then prefills; `step` is what the runner gets."""
    scheduled: tuple[ScheduledRequest, ...]
    num_decodes: int
    preempted_ids: tuple[str, ...] = ()
    step: StepInput = StepInput()

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Counters the tests and the benchmark read."""
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0       # prompt tokens looked up
    num_prefix_cache_hits: int = 0          # of which found cached, or shared with another sample (n > 1)
    num_steps: int = 0
    host_s: float = 0.0                     # engine.step() wall time, less the part spent waiting for the device
    device_wait_s: float = 0.0              # part of engine.step() spent waiting for a step's tokens
    num_generated_tokens: int = 0           # tokens appended to outputs (several a step with speculation)
    num_draft_tokens: int = 0               # proposed tokens verified
    num_accepted_tokens: int = 0            # of which accepted
    num_verified_requests: int = 0          # request-steps that verified at least one proposal

    def spec_summary(self) -> dict[str, float]:
        """Acceptance rate (accepted / proposed), mean acceptance length (tokens a verified request emits in a
        step: its accepted proposals and one more) and tokens per step (generated tokens / steps)."""
        return {"acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "mean_acceptance_length": 1 + self.num_accepted_tokens / max(self.num_verified_requests, 1),
                "tokens_per_step": self.num_generated_tokens / max(self.num_steps, 1)}


class Scheduler:
    """Decides which requests run in each step and how many tokens of each."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheCoordinator, max_model_len: int,
                 speculative: SpeculativeConfig | None = None, proposer=None):
        self.config = config
        self.speculative = speculative
        # a proposer with `propose_batch` (a draft model) answers for the step's requests at once, before the
        # loop below; the n-gram proposer answers per request inside it
        # with async scheduling, proposals are made on the device (`spec_decode/device_verify.py`): the scheduler
        # gives each decoding request a query of k + 1 tokens and reserves KV for the most it may need (a draft
        # model's too: its proposer's `reserve`)
        self.device_drafts = (speculative.num_speculative_tokens if speculative is not None
                              and config.async_scheduling else 0)
        if proposer is None and speculative is not None and not self.device_drafts:
            proposer = NgramProposer(speculative)
        self.proposer = proposer
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.forks: dict[str, PromptFork] = {}      # by request id: the samples of n > 1 that share a prompt
        self.stats = SchedulerStats()
        # what the runner has been told: blocks sent per running request and group, and ids to drop from its table
        self._sent_blocks: dict[str, list[int]] = {}
        self._finished_ids: list[str] = []
        self._no_new_blocks = ((),) * len(kv.managers)
        self.num_constrained = 0     # unfinished requests with a grammar (structured output)

    def add_request(self, request: Request, fork: PromptFork | None = None) -> None:
        """Queue `request`; `fork`: the prompt blocks it shares as one of the n > 1 samples of a request."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self.num_constrained += 1
        if fork is not None:
            self.forks[request.request_id] = fork
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []         # every request of the step, in scheduling order
        decodes: list[ScheduledRequest] = []           # single-token queries (they lead the batch)
        prefills: list[ScheduledRequest] = []
        preempted: list[str] = []
        new_reqs: list[NewRequest] = []
        running_reqs: list[RunningRequest] = []

        kv, max_len = self.kv, self.max_model_len
        # a request whose blocks already hold the step's tokens needs no allocator call: the common decode step
        # costs a compare (sliding windows release what they slid past at the next allocator call)
        capacity = kv.req_capacity
        propose = ((self.proposer is not None or self.device_drafts)
                   and len(self.running) <= self.speculative.disable_by_batch_size)
        batch_proposer = not self.device_drafts and hasattr(self.proposer, "propose_batch")
        drafted = self._propose_batch() if propose and batch_proposer else None
        positions: list[int] = []       # of `scheduled`: position rows (device_drafts)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            pending, num_out = req.num_pending, len(req.output_token_ids)
            num_tokens = len(req.prompt_token_ids) + num_out
            slack = req.num_spec_slack
            if pending and (num_out + pending + slack >= req.max_tokens or num_tokens + pending + slack >= max_len):
                i += 1       # its tokens in flight may be its last: it finishes, or goes on, when they arrive
                continue
            computed = req.num_computed_tokens
            end = num_tokens + pending
            if self.device_drafts and end - computed == 1:
                s = self._schedule_position_row(req, propose, budget, preempted, running_reqs)
                if s is None:
                    break   # req preempted itself: nothing after it is left in running
                positions.append(len(scheduled))
                scheduled.append(s)
                (decodes if s.num_new_tokens == 1 else prefills).append(s)
                budget -= s.num_new_tokens
                i += 1
                continue
            num_new = min(end - computed, budget)
            drafts = ()
            if propose and end - computed == 1 and not pending and budget > 1:
                room = min(budget, max_len - num_tokens) - 1
                if drafted is None:
                    drafts = propose_for(self.proposer, req.prompt_token_ids, req.output_token_ids,
                                         req.sampling_params, req.max_tokens, room)
                else:   # a prefix of a greedy draft's proposals is what it would have proposed with less room
                    drafts = drafted.get(req.request_id, ())[:max(room, 0)]
                num_new += len(drafts)
            if computed + num_new > capacity.get(req.request_id, 0):
                while not kv.try_allocate(req, computed + num_new):
                    if drafts:      # proposals never cost another request its place: drop them first
                        num_new, drafts = num_new - len(drafts), ()
                        continue
                    victim = self.running.pop()     # the newest running request
                    self._preempt(victim)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
                else:
                    new_blocks = self._new_blocks(req, kv.block_ids(req))
                    if new_blocks is not self._no_new_blocks:
                        running_reqs.append(RunningRequest(req.request_id, new_blocks))
                if req.status is not RequestStatus.RUNNING:
                    break   # req preempted itself: nothing after it is left in running
            samples = computed + num_new == end or bool(drafts)
            s = ScheduledRequest(req, computed, num_new, samples, drafts)
            scheduled.append(s)
            (decodes if num_new == 1 else prefills).append(s)
            req.num_computed_tokens = computed + num_new
            if samples:
                req.num_pending = pending + 1
            budget -= num_new
            i += 1

        # new requests only when nobody had to be preempted (they would just be preempted next)
        compiling: list[Request] = []     # whose grammar is not compiled yet: they keep their place in the queue
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
            fork = self.forks.get(req.request_id)
            if fork is None:
                cached = self.kv.find_cached_prefix(req)
            else:
                cached = fork.admission_prefix(req, self.kv, self.stats.num_steps, scheduled)
                if cached is None:
                    break    # a sample waits in line until the first sample has computed the shared prompt
            num_cached_tokens = len(cached[0]) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached_tokens, budget)
            if not self.kv.try_allocate(req, num_cached_tokens + num_new, cached):
                break
            self.waiting.popleft()
            self.stats.num_prefix_cache_queries += req.num_tokens
            self.stats.num_prefix_cache_hits += num_cached_tokens
            req.num_computed_tokens = num_cached_tokens
            req.num_cached_prompt_tokens = num_cached_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            new_reqs.append(self._new_request(req))
            s = self._schedule(req, num_new)
            scheduled.append(s)
            (decodes if num_new == 1 else prefills).append(s)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

        ordered = tuple(decodes + prefills)
        self.stats.num_steps += 1
        grammar_rows = (tuple([i for i, s in enumerate(ordered) if s.samples and s.request.grammar is not None])
                        if self.num_constrained else ())
        position_rows = (tuple([i for i, s in enumerate(ordered) if s.device_drafts is not None])
                         if positions else ())
        # list comprehensions, not generators: a third of the time at 256 requests
        step = StepInput(tuple(new_reqs), tuple(running_reqs), self.take_finished_ids(),
                         tuple([s.request.request_id for s in ordered]), tuple([s.num_new_tokens for s in ordered]),
                         len(decodes), tuple([s.num_computed_tokens for s in ordered]),
                         tuple([s.spec_token_ids for s in ordered]) if any(s.spec_token_ids for s in ordered) else (),
                         grammar_rows, position_rows, self.device_drafts)
        return SchedulerOutput(ordered, len(decodes), tuple(preempted), step)

    def _schedule_position_row(self, req: Request, propose: bool, budget: int, preempted: list[str],
                               running_reqs: list[RunningRequest]) -> ScheduledRequest | None:
        """A decoding request's row under async speculation: its last token, and k proposals the device makes when
        it may speculate (a query of k + 1 tokens). The step in flight may have emitted up to k + 1 tokens the host
        has not seen, so KV is reserved for the most this row can reach; the computed count advances by one (the
        least), and `update` adds what was accepted. None: the request preempted itself."""
        k, max_len = self.device_drafts, self.max_model_len
        pending, slack = req.num_pending, req.num_spec_slack
        num_out = len(req.output_token_ids) + pending      # at least
        end = req.num_tokens + pending                     # the device's token count: at least this,
        latest = end + slack                               # at most this
        width = 1
        # a draft model's cache holds the row's tokens and the k - 1 proposals it runs itself, at most
        reserve = getattr(self.proposer, "reserve", None)
        if (propose and budget > k and latest + k + 1 <= max_len
                and proposal_limit(req.sampling_params, num_out, req.max_tokens, k) > 0
                and (reserve is None or reserve(req.request_id, latest + k - 1))):
            width = k + 1
        kv = self.kv
        while latest - 1 + width > kv.req_capacity.get(req.request_id, 0):
            if kv.try_allocate(req, latest - 1 + width):
                new_blocks = self._new_blocks(req, kv.block_ids(req))
                if new_blocks is not self._no_new_blocks:
                    running_reqs.append(RunningRequest(req.request_id, new_blocks))
                break
            if width > 1:       # proposals never cost another request its place: drop them first
                width = 1
                continue
            victim = self.running.pop()     # the newest running request
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return None
        req.num_computed_tokens = end
        req.num_pending = pending + 1
        req.num_spec_slack = slack + width - 1
        return ScheduledRequest(req, latest - 1, width, True, (), width - 1)

    def _propose_batch(self) -> dict[str, tuple[int, ...]]:
        """The batch proposer's proposals for every running request that decodes its last token this step, each
        as many as its own limits allow (the step's token budget trims them in `schedule`)."""
        wanted = []
        for req in self.running:
            num_tokens = req.num_tokens
            if req.num_pending or num_tokens - req.num_computed_tokens != 1:
                continue
            limit = proposal_limit(req.sampling_params, len(req.output_token_ids), req.max_tokens,
                                   self.max_model_len - num_tokens - 1)
            if limit > 0:
                wanted.append((req.request_id, (*req.prompt_token_ids, *req.output_token_ids), limit))
        return self.proposer.propose_batch(wanted) if wanted else {}

    def take_finished_ids(self) -> tuple[str, ...]:
        """Ids of requests the runner holds that finished, were aborted or preempted since the last step; the
        caller passes them to the runner (in a `StepInput`), which drops their rows."""
        ids = tuple(self._finished_ids)
        self._finished_ids.clear()
        return ids

    def requeue_finished_ids(self, ids: tuple[str, ...]) -> None:
        """Send these ids again with the next step (the step that carried them failed)."""
        self._finished_ids.extend(ids)

    def _new_request(self, req: Request) -> NewRequest:
        """The runner's first view of a request (again, after a preemption: with the tokens it generated)."""
        blocks = self.kv.block_ids(req)
        self._sent_blocks[req.request_id] = [len(b) for b in blocks]
        return NewRequest(req.request_id, tuple(req.prompt_token_ids), req.sampling_params, req.sampling_seed,
                          tuple(tuple(b) for b in blocks), req.num_computed_tokens, tuple(req.output_token_ids),
                          req.eos_token_ids)

    def _new_blocks(self, req: Request, blocks: tuple[list[int], ...]) -> tuple[tuple[int, ...], ...]:
        """Per group, the blocks the request gained since the runner last heard of it."""
        sent = self._sent_blocks[req.request_id]
        if all(len(b) == n for b, n in zip(blocks, sent)):
            return self._no_new_blocks           # the common decode step: a block lasts block_size steps
        new = tuple(tuple(b[n:]) for b, n in zip(blocks, sent))
        sent[:] = [len(b) for b in blocks]
        return new

    def _forget(self, req: Request) -> None:
        """The runner drops the request's row at the next step."""
        if self._sent_blocks.pop(req.request_id, None) is not None:
            self._finished_ids.append(req.request_id)
        if hasattr(self.proposer, "drop"):
            self.proposer.drop(req.request_id)

    def _last_token_in_flight(self, req: Request) -> bool:
        """Whether the token a step in flight samples for `req` reaches its max_tokens or max_model_len."""
        return req.num_pending > 0 and (len(req.output_token_ids) + req.num_pending >= req.max_tokens
                                        or req.num_tokens + req.num_pending >= self.max_model_len)

    def _schedule(self, req: Request, num_new: int) -> ScheduledRequest:
        """A new request's share of this step; its computed count advances now, so that the next step can be
        scheduled before this one's tokens reach the host (a sampled token stays pending until `update`)."""
        computed = req.num_computed_tokens
        samples = computed + num_new == req.num_tokens + req.num_pending
        req.num_computed_tokens = computed + num_new
        if samples:
            req.num_pending += 1
        return ScheduledRequest(req, computed, num_new, samples)

    def _preempt(self, req: Request) -> None:
        self._forget(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_pending = 0      # a token in flight is dropped; recomputation samples it again (same seed, counter)
        req.num_spec_slack = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, output: SchedulerOutput, sampled: Sequence[int],
               spec_token_ids: Sequence[Sequence[int]] | None = None,
               num_proposed: Sequence[int] | None = None) -> list[tuple[Request, int]]:
        """Append a step's sampled tokens (`sampled[i]` is batch row i's; rows that do not sample are ignored) and
        publish its full blocks; returns (request, batch row) of the requests that received a token. A verify
        step's rows emit `spec_token_ids[i]` after `sampled[i]`: a request's KV then holds its last token and the
        accepted proposals, and its computed count drops back to that (the rest is overwritten later). A position
        row's computed count advances by the accepted proposals; `num_proposed[i]`: its real proposals."""
        got_token = []
        running, kv = RequestStatus.RUNNING, self.kv
        # every token before this step's end is known on the host now: blocks it filled can be hashed
        published = kv.req_num_published if kv.pool.enable_prefix_caching else None
        bs = kv.block_size
        for row, s in enumerate(output.scheduled):
            req = s.request
            if req.status is not running:
                continue   # finished, aborted or preempted while the step ran: its token is dropped
            end = s.num_computed_tokens + s.num_new_tokens
            if s.samples:
                req.num_pending -= 1
                req.output_token_ids.append(sampled[row])
                got_token.append((req, row))
                more = ()
                if spec_token_ids is not None:
                    more = spec_token_ids[row]
                    req.output_token_ids.extend(more)
                    self.stats.num_generated_tokens += len(more)
                    if s.spec_token_ids:
                        end = req.num_computed_tokens = s.num_computed_tokens + 1 + len(more)
                        self.stats.num_draft_tokens += len(s.spec_token_ids)
                        self.stats.num_accepted_tokens += len(more)
                        self.stats.num_verified_requests += 1
                if s.device_drafts is not None:
                    # the row wrote KV from the last token the host now knows through the accepted proposals
                    req.num_computed_tokens += len(more)
                    req.num_spec_slack -= s.device_drafts
                    end = req.num_tokens - 1
                    if num_proposed is not None and num_proposed[row]:
                        self.stats.num_draft_tokens += num_proposed[row]
                        self.stats.num_accepted_tokens += len(more)
                        self.stats.num_verified_requests += 1
                self.stats.num_generated_tokens += 1
            if published is not None and end // bs > published.get(req.request_id, 0):
                kv.cache_full_blocks(req, end)
        return got_token

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request and free its blocks at once."""
        if req.status.finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if req.grammar is not None:
            self.num_constrained -= 1
        self._forget(req)
        fork = self.forks.pop(req.request_id, None)
        if fork is not None:
            fork.on_finish(req, status, self.kv, self.stats.num_steps)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; returns whether it was found."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return True
