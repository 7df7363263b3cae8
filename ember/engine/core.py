"""The engine core: the token-level half of the engine. It holds the scheduler, the KV-cache coordinator and the
executor, takes requests as token ids with their sampling parameters, and gives back, each step, the new token of
every request that got one, the logprobs asked for (as token ids and numbers), and how requests finished (a stop
token, or their length). Text, stop strings and the shape of outputs belong to the front end
(`ember.engine.output_processor`), which stops a request whose stop string matched through `finish_requests`.

The core runs in the front end's process (`Engine` over `EngineCore` directly: no copies, no messages), or in a
process of its own (`ember.engine.core_proc`) behind a client (`ember.engine.core_client`); its inputs and outputs
are plain data either way, so the same types cross the process boundary.
"""

from __future__ import annotations

import logging
import os
import time

from ember.config import EngineConfig
from ember.executor import make_executor
from ember.engine.core_io import CoreInfo, CoreStats, EngineCoreOutputs, EngineCoreRequest, PromptLogprobData
from ember.engine.kv_manager import KVCacheCoordinator
from ember.engine.prompt_fork import PromptFork
from ember.engine.request import Request, RequestStatus
from ember.engine.sample_group import sample_request_id
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.profiling import section
from ember.runner.output import ModelRunnerOutput
from ember.runner.step_input import NewRequest, StepInput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")


def resident_bytes() -> int:
    """This process's resident memory in bytes (/proc/self/statm, as the server's process_resident_memory_bytes);
    0 where there is no /proc."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class EngineCore:
    """Owns the scheduler, the KV-cache coordinator and the executor; `step()` advances every unfinished request by
    one step and returns what it produced."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto",
                 tokenizer=None, rendezvous=None):
        self.config = config
        self.tokenizer = tokenizer      # for its EOS ids, and the vocabulary structured output compiles against
        # rank 0's ModelRunner, or the executor of every tensor-parallel rank with the same surface (its ranks meet
        # at `rendezvous`, a data-parallel replica's own; None: where the environment says)
        self.executor = make_executor(config, model_path, hf_config=hf_config, load_format=load_format,
                                      rendezvous=rendezvous)
        self.max_model_len = self.executor.max_model_len
        self.vocab_size = self.executor.vocab_size
        self.kv = KVCacheCoordinator(self.executor.attn.groups, self.executor.num_blocks,
                                     config.cache.enable_prefix_caching)
        proposer = None
        if config.speculative is not None and config.speculative.method == "draft_model":
            from ember.spec_decode.draft_model import build_draft_proposer
            proposer = build_draft_proposer(config, load_format, self.executor, tokenizer)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, config.speculative, proposer)
        self.eos_token_ids = _eos_ids(self.executor.hf_config, tokenizer)
        self._in_flight: LaunchedStep | None = None
        self._structured = None     # StructuredOutputs, made at the first request with a grammar
        self._out = EngineCoreOutputs()
        self._logged_drafts = 0     # proposals counted when speculation's figures were last logged
        self._step_s = 0.0          # wall time in step()
        self._busy_s = 0.0          # of which not waiting for the device

    @property
    def runner(self):
        """The executor (with one process, the model runner itself)."""
        return self.executor

    @property
    def stats(self):
        return self.scheduler.stats

    @property
    def structured(self):
        """The structured-output state (`StructuredOutputs`: grammar compiles and matchers), made on first use."""
        if self._structured is None:
            from ember.engine.structured_output import StructuredOutputs
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._structured

    def info(self) -> CoreInfo:
        s = self.config.scheduler
        return CoreInfo(self.max_model_len, self.vocab_size, self.executor.num_blocks, self.kv.block_size,
                        self.eos_token_ids, s.max_num_seqs, s.max_num_batched_tokens)

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request (its samples, with n > 1); ValueError if one of its ids is in use."""
        rid, prompt, params = request.request_id, request.prompt_token_ids, request.sampling_params
        n = params.n
        ids = [rid] if n == 1 else [sample_request_id(rid, i) for i in range(n)]
        taken = [i for i in ids if i in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {rid!r} is already in use" if n == 1 else
                             f"request_id {rid!r} cannot be used with n={n}: the id {taken[0]!r} of one of its "
                             f"samples is already in use")
        if len(request.sampling_seeds) != n:
            raise ValueError(f"request {rid!r} has n={n} but {len(request.sampling_seeds)} sampling seeds")
        room = self.max_model_len - len(prompt)
        max_tokens = min(params.max_tokens or room, room)
        eos = self.eos_token_ids
        stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else eos)
        reqs = [Request(i, prompt, params, eos_token_ids=eos, sampling_seed=seed, max_tokens=max_tokens,
                        stop_ids=stop_ids) for i, seed in zip(ids, request.sampling_seeds)]
        if params.structured_outputs is not None:
            for req in reqs:            # compiles (once per distinct grammar) while the request waits
                self.structured.attach(req)
        fork = None
        if n > 1:
            # the samples share the prompt's whole blocks, leaving a token to compute (`prompt_fork`)
            num_shared = (len(prompt) - 1) // self.kv.block_size * self.kv.block_size
            fork = PromptFork(reqs[0], num_shared, n) if num_shared else None
        for req in reqs:       # nothing here can fail: every id was checked above
            self.scheduler.add_request(req, fork)

    def abort_requests(self, request_ids) -> None:
        """Abort these requests (ids the core does not hold are ignored); their blocks are freed at once."""
        for rid in request_ids:
            self.scheduler.abort(rid)

    def finish_requests(self, request_ids) -> None:
        """Finish these requests as stopped (a stop string matched in the front end): a sample that leads others
        leaves them its prompt blocks, as it would at a stop token."""
        requests = self.scheduler.requests
        for rid in request_ids:
            req = requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def has_unfinished(self) -> bool:
        # a step in flight holds only running requests, which the scheduler counts; once they are all finished or
        # aborted its tokens are of no use, and a step drops them (at once when the last request ends in a step)
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        """Advance every unfinished request by one step; returns the tokens and finishes produced.

        With async scheduling the next step is scheduled and launched while the previous one still runs on the
        device, and the previous one's tokens are processed after: a call returns what the step before it
        produced. A request that stops has then run one extra step, whose token is dropped. A step that fails
        aborts its requests and names them in the outputs (`failed_ids`, `failure`); the core goes on."""
        start = time.perf_counter()
        stats = self.scheduler.stats
        waited_before = stats.device_wait_s
        try:
            self._step()
        except _StepFailed:
            pass
        finally:
            elapsed = time.perf_counter() - start
            self._step_s += elapsed
            self._busy_s += elapsed - (stats.device_wait_s - waited_before)
        return self.take_outputs()

    def take_outputs(self) -> EngineCoreOutputs:
        """The outputs gathered since the last call (their `stats` are set by whoever sends them: `load()`)."""
        out, self._out = self._out, EngineCoreOutputs()
        return out

    def load(self, busy_s: float = 0.0, memory: tuple[int, int, int] = (0, 0, 0)) -> CoreStats:
        """The current load and counters; `busy_s` is added to the steps' host time (the process loop's own),
        `memory` is (allocated, reserved) device bytes and resident bytes as last read (`memory_use`)."""
        scheduler, kv = self.scheduler, self.kv
        s = scheduler.stats
        total = max(self.executor.num_blocks - 1, 1)     # block 0 is the null block, never handed out
        allocated, reserved, resident = memory
        return CoreStats(len(scheduler.running), len(scheduler.waiting), total - kv.num_free_blocks, total,
                         s.num_steps, self._busy_s + busy_s, self._step_s, s.num_preemptions,
                         s.num_prefix_cache_queries, s.num_prefix_cache_hits, len(scheduler.requests),
                         self.executor.table.num_rows, allocated, reserved, s.num_generated_tokens,
                         s.num_draft_tokens, s.num_accepted_tokens, s.num_verified_requests, resident)

    def memory_use(self) -> tuple[int, int, int]:
        """(allocated, reserved) bytes torch holds on the core's device ((0, 0) off CUDA), and this process's
        resident bytes (0 where /proc does not say)."""
        resident = resident_bytes()
        device = self.executor.device
        if device.type != "cuda":
            return 0, 0, resident
        import torch
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), resident

    def _step(self) -> None:
        if self._structured is not None:
            self._fail_grammars()
        with section("ember.schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            if out.step.finished_ids:     # the runner drops their rows
                self.executor.update_table(out.step)
            if self._in_flight is not None:
                self._resolve()
            elif self._structured is not None:
                self._structured.wait_for_compiles()    # nothing to run until a grammar is ready: no busy loop
            self._end_step()
            return
        if out.step.new_requests:
            cached, requests = self._out.num_cached_tokens, self.scheduler.requests
            for new in out.step.new_requests:
                cached[new.req_id] = requests[new.req_id].num_cached_prompt_tokens
        try:
            if out.step.grammar_rows:
                launched = self.structured.launch(self.executor, out, self._in_flight, self.stats)
            else:
                launched = self.executor.execute_async(out.step)
        except Exception as e:
            # the runner may not have dropped these rows yet; dropping one twice is harmless
            self.scheduler.requeue_finished_ids(out.step.finished_ids)
            self._fail([s.request for s in out.scheduled], e)
        # the new step is in flight before the previous one is processed, so that a failure there loses neither
        previous, self._in_flight = self._in_flight, LaunchedStep(out, launched)
        if previous is not None:
            self._process(previous)
        if not self.config.scheduler.async_scheduling or not self.scheduler.has_unfinished():
            # sync; or every request of the step in flight has ended: drop its tokens now rather than hold it
            self._resolve()
        self._end_step()

    def _end_step(self) -> None:
        if self._in_flight is None and not self.scheduler.has_unfinished():
            # nothing left to run: the runner drops the rows of requests that just ended now, not at a later step
            finished_ids = self.scheduler.take_finished_ids()
            if finished_ids:
                self.executor.update_table(StepInput(finished_ids=finished_ids))
            stats = self.scheduler.stats
            if stats.num_draft_tokens != self._logged_drafts:     # speculation's figures, once a batch is done
                self._logged_drafts = stats.num_draft_tokens
                logger.info("speculative decoding: %s", ", ".join(f"{k.replace('_', ' ')} {v:.3f}"
                                                                  for k, v in stats.spec_summary().items()))

    def _fail(self, requests: list[Request], error: BaseException) -> None:
        """Abort the requests of a failed step that are still unfinished, name them in the outputs, and end the
        step."""
        failed = []
        for req in requests:
            if self.scheduler.requests.get(req.request_id) is req:   # not finished, aborted or replaced
                self.scheduler.abort(req.request_id)
                failed.append(req.request_id)
        logger.error("a step failed (%s: %s); aborted requests %s", type(error).__name__, error, failed)
        out = self._out
        out.failed_ids.extend(failed)
        out.failure = f"{type(error).__name__}: {error}"
        out.cause = error
        raise _StepFailed() from error

    def _resolve(self) -> None:
        """Wait for the step in flight and process its tokens."""
        step, self._in_flight = self._in_flight, None
        self._process(step)

    def _fail_grammars(self) -> None:
        """End requests whose grammar failed to compile (the failure names them)."""
        failed = self._structured.take_failed()
        if failed:
            self._fail([req for req, _ in failed], failed[0][1])

    def _process(self, step: LaunchedStep) -> None:
        """Wait for a launched step and process its tokens; a failure aborts the step's requests."""
        out = step.out
        start = time.perf_counter()
        try:
            result = step.handle.result()
        except Exception as e:
            self._fail([s.request for s in out.scheduled], e)
        self.scheduler.stats.device_wait_s += time.perf_counter() - start
        try:
            with section("ember.update"):
                if out.step.grammar_rows and not step.grammar_advanced:
                    step.grammar_advanced = True
                    self.structured.advance(out, result.sampled_token_ids)
                self._update(out, result)
        except Exception as e:
            self._fail([s.request for s in out.scheduled], e)

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        sampled, spec = result.sampled_token_ids, result.spec_token_ids
        updated = self.scheduler.update(out, sampled, spec, result.num_proposed)
        buf = self._out
        batch_ids = out.step.req_ids
        if spec is None and len(updated) == len(batch_ids):
            # the common step: every row got one token, and the batch's own lists are the outputs' columns
            ids, tokens, build = batch_ids, sampled, False
        else:
            ids, tokens, build = [], [], True
        want_logprobs = result.logprobs is not None
        finish, finished, stride = self.scheduler.finish, buf.finished, result.logprob_stride
        for req, row in updated:
            if spec is not None and spec[row]:
                self._update_run(req, result, row, ids, tokens)
                continue
            output_ids = req.output_token_ids
            token = output_ids[-1]
            if build:
                ids.append(req.request_id)
                tokens.append(token)
            if want_logprobs and req.sampling_params.logprobs is not None:
                self._record_logprobs(req, result, row * stride)
            num_out = len(output_ids)
            if token in req.stop_ids and num_out >= req.sampling_params.min_tokens:
                finish(req, RequestStatus.FINISHED_STOPPED)
                finished[req.request_id] = ("stop", token if token in req.sampling_params.stop_token_ids else None,
                                            num_out)
            elif req.grammar is not None and req.grammar.terminated:
                # complete (nothing but EOS may follow), or the grammar refused the token
                error = req.grammar.error is not None
                finish(req, RequestStatus.FINISHED_ABORTED if error else RequestStatus.FINISHED_STOPPED)
                finished[req.request_id] = ("abort" if error else "grammar", None, num_out)
            elif num_out >= req.max_tokens:      # max_tokens never exceeds the room left in max_model_len
                finish(req, RequestStatus.FINISHED_LENGTH)
                finished[req.request_id] = ("length", None, num_out)
        if buf.req_ids:          # a second step processed in one call: new lists, the batch's are not ours to grow
            ids, tokens = list(buf.req_ids) + list(ids), list(buf.new_token_ids) + list(tokens)
        buf.req_ids, buf.new_token_ids = ids, tokens

    def _update_run(self, req: Request, result: ModelRunnerOutput, row: int, ids: list, tokens: list) -> None:
        """A verify step's row emitted several tokens (appended by the scheduler): take them back and add them one
        at a time, so that a stop token or max_tokens ends the output there and nothing after it is sent. Each
        token is an entry of its own in the outputs' columns."""
        output_ids = req.output_token_ids
        run = output_ids[-1 - len(result.spec_token_ids[row]):]
        del output_ids[-len(run):]
        p = req.sampling_params
        want_logprobs = result.logprobs is not None and p.logprobs is not None
        for j, token in enumerate(run):
            output_ids.append(token)
            ids.append(req.request_id)
            tokens.append(token)
            if want_logprobs:
                self._record_logprobs(req, result, row * result.logprob_stride + j)
            num_out = len(output_ids)
            status = None
            if token in req.stop_ids and num_out >= p.min_tokens:
                status = RequestStatus.FINISHED_STOPPED
                reason = ("stop", token if token in p.stop_token_ids else None, num_out)
            elif num_out >= req.max_tokens:
                status, reason = RequestStatus.FINISHED_LENGTH, ("length", None, num_out)
            if status is not None:
                self.scheduler.finish(req, status)
                self._out.finished[req.request_id] = reason
                # a verify row emits up to k + 1 tokens whatever is left to generate: those past the end are dropped
                self.stats.num_generated_tokens -= len(run) - 1 - j
                return

    def _record_logprobs(self, req: Request, result: ModelRunnerOutput, slot: int) -> None:
        n = req.sampling_params.logprobs
        entry = (result.logprob_token_ids[slot][:1 + n], result.logprobs[slot][:1 + n], result.ranks[slot])
        self._out.logprobs.setdefault(req.request_id, []).append(entry)

    # ---- scoring ----------------------------------------------------------------------------------------------
    def score(self, token_ids: list[int]) -> "torch.Tensor":
        """Teacher-forced logits [len(token_ids), V] of one sequence, computed through the paged cache in one
        prefill step. Runs only while no other request is in flight."""
        return self._scoring_step(token_ids, self.executor.all_logits)

    def prompt_logprobs(self, token_ids: list[int], k: int) -> "PromptLogprobData":
        """The logprob of every prompt token after the ones before it, its rank, and the `k` most likely tokens at
        each position, as token ids and numbers (`Engine.prompt_logprobs` makes the entries). The runner computes
        them a chunk of rows at a time: the whole prompt's logits never exist at once."""
        chosen, ranks, top_ids, top_logprobs = self._scoring_step(
            token_ids, lambda step: self.executor.prompt_logprobs(step, k))
        if not k:
            empty = [[] for _ in range(len(chosen))]
            return PromptLogprobData(chosen.tolist(), ranks.tolist(), empty, empty)
        return PromptLogprobData(chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_logprobs.tolist())

    def _scoring_step(self, token_ids: list[int], run):
        """`run(step)` on one prefill step of `token_ids` from position 0, its blocks held for the call."""
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine; finish or abort running requests first")
        token_ids = list(token_ids)
        if len(token_ids) > self.config.scheduler.max_num_batched_tokens:
            raise ValueError(f"{len(token_ids)} tokens exceed max_num_batched_tokens "
                             f"{self.config.scheduler.max_num_batched_tokens} for one scoring step")
        req = Request("__score__", token_ids, SamplingParams())
        if not self.kv.try_allocate(req, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit in the KV cache")
        try:
            blocks = tuple(tuple(b) for b in self.kv.block_ids(req))
            # rows of requests that finished in the last step leave the runner's table first
            step = StepInput(new_requests=(NewRequest(req.request_id, tuple(token_ids), req.sampling_params, 0,
                                                      blocks, 0),),
                             finished_ids=self.scheduler.take_finished_ids(),
                             req_ids=(req.request_id,), num_scheduled_tokens=(len(token_ids),),
                             num_decodes=1 if len(token_ids) == 1 else 0, num_computed_tokens=(0,))
            return run(step)
        finally:
            self.kv.free(req)

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.close()
        self.executor.shutdown()


class _StepFailed(Exception):
    """A step failed; its requests are aborted and named in the outputs."""


class LaunchedStep:
    """A step in flight: what the scheduler decided, the executor's handle on its tokens, and whether its
    constrained rows' grammars have consumed its tokens yet (they may, before the step is processed)."""
    __slots__ = ("out", "handle", "grammar_advanced")

    def __init__(self, out: SchedulerOutput, handle):
        self.out, self.handle, self.grammar_advanced = out, handle, False


def _eos_ids(hf_config, tokenizer) -> tuple[int, ...]:
    """The EOS ids of the model's config and of its tokenizer."""
    ids: set[int] = set()
    for src in (getattr(hf_config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return tuple(sorted(ids))
