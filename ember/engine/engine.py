"""The step loop: validate and add requests, schedule, execute, update, detokenize, stop."""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass


from ember.config import EngineConfig
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.kv_manager import KVCacheCoordinator
from ember.engine.prompt_fork import PromptFork
from ember.engine.sample_group import SampleGroup, sample_request_id, sample_seeds
from ember.distributed.executor import make_executor
from ember.runner.output import ModelRunnerOutput
from ember.runner.step_input import NewRequest, StepInput
from ember.sampling_params import SamplingParams, as_int
from ember.engine.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.profiling import section

logger = logging.getLogger("ember")


class EngineStepError(RuntimeError):
    """A step failed. The requests it held were aborted (each gets a final output with finish_reason "abort" from
    the next `step()`); every other request goes on, and so does the engine."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        self.request_ids = request_ids
        super().__init__(f"a step failed with {type(cause).__name__}: {cause}; its requests {request_ids} were "
                         f"aborted and the engine goes on serving the others")


class LaunchedStep:
    """A step in flight: what the scheduler decided, the runner's handle on its tokens, and whether its
    constrained rows' grammars have consumed its tokens yet (they may, before the step is processed)."""
    __slots__ = ("out", "handle", "grammar_advanced")

    def __init__(self, out: SchedulerOutput, handle):
        self.out, self.handle, self.grammar_advanced = out, handle, False


@dataclass
class _Tracked:
    """Host-side state of a request's output beyond its tokens."""
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # the tokens that may end the request (stop_token_ids, and EOS unless ignore_eos), and whether a token that
    # is none of them and leaves room needs no more than an append (no logprobs, no stop strings to look for)
    stop_ids: frozenset[int] = frozenset()
    plain: bool = False
    stop_reason: int | str | None = None
    finish_reason: str | None = None
    group: SampleGroup | None = None      # one of n > 1 samples: its output is the group's
    index: int = 0                        # its index among them


class Engine:
    """Owns the scheduler and the model runner; `step()` advances every unfinished request by one step."""

    def __init__(self, config: EngineConfig, model_path: str, tokenizer=None, hf_config=None,
                 load_format: str = "auto"):
        self.config = config
        self.tokenizer = tokenizer
        # rank 0's ModelRunner, or the executor of every tensor-parallel rank with the same surface
        self.runner = make_executor(config, model_path, hf_config=hf_config, load_format=load_format)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.kv = KVCacheCoordinator(self.runner.attn.groups, self.runner.num_blocks,
                                     config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, config.speculative)
        self.eos_token_ids = self._eos_ids()
        self._rng = random.Random(config.model.seed)
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}
        self._ready: list[RequestOutput] = []   # outputs made but not yet returned by step(): aborts, failures
        self._groups: dict[str, SampleGroup] = {}     # unfinished requests with n > 1, by request id
        self._ready_groups: list[SampleGroup] = []    # whose output step() makes when it returns
        self._in_flight: LaunchedStep | None = None
        self._logged_drafts = 0             # proposals counted when speculation's figures were last logged
        self._structured = None             # StructuredOutputs, made at the first request with a grammar

    def _eos_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for src in (getattr(self.runner.hf_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None):
            if isinstance(src, int):
                ids.add(src)
            elif src:
                ids.update(int(i) for i in src)
        return tuple(sorted(ids))

    # ---- requests ---------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the value and the limit if the request cannot be served (TypeError naming the
        parameter for a value of the wrong type)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__} {params!r}")
        prompt_token_ids = token_id_list(prompt_token_ids)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids entry {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens; with at least one generated token it exceeds "
                             f"max_model_len {self.max_model_len}")
        if params.n > self.config.scheduler.max_num_seqs:
            raise ValueError(f"n {params.n} exceeds max_num_seqs {self.config.scheduler.max_num_seqs}: the samples "
                             f"of one prompt must fit in one batch; lower n or raise max_num_seqs")
        if params.structured_outputs is not None:
            self.check_structured_output(params.structured_outputs)

    def check_structured_output(self, structured_outputs) -> None:
        """Raise ValueError naming the problem if the grammar cannot be served (any thread may call it)."""
        from ember.engine.structured_output import check_request
        check_request(structured_outputs, self.config, self.tokenizer)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id."""
        prompt_token_ids = token_id_list(prompt_token_ids)
        self.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._tracked or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n > 1:
            return self._add_samples(prompt_token_ids, params, prompt, request_id)
        seed = sample_seeds(params.seed, 1, self._rng)[0]
        tracked = self._track(request_id, prompt_token_ids, params, prompt, seed)
        self.scheduler.add_request(tracked.request)  # last: nothing after it can fail and leave it half added
        self._tracked[request_id] = tracked
        return request_id

    def _track(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
               seed: int) -> _Tracked:
        room = self.max_model_len - len(prompt_token_ids)
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids, sampling_seed=seed,
                      max_tokens=min(params.max_tokens or room, room))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                       params.include_stop_str_in_output)
        stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids)
        if params.structured_outputs is not None:
            self.structured.attach(req)
        return _Tracked(req, prompt, detok, [] if params.logprobs is not None else None,
                        0.0 if params.logprobs is not None else None, stop_ids,
                        params.logprobs is None and not params.stop and req.grammar is None)

    @property
    def structured(self):
        """The structured-output state (`StructuredOutputs`), made on first use."""
        if self._structured is None:
            from ember.engine.structured_output import StructuredOutputs
            self._structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._structured

    def _add_samples(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None,
                     request_id: str) -> str:
        """Queue the n samples of one request (see `sample_group` and `prompt_fork`): each its own request with
        its own seed, the first computing the prompt and the others sharing its full prompt blocks."""
        ids = [sample_request_id(request_id, i) for i in range(params.n)]
        taken = [i for i in ids if i in self._tracked or i in self._groups or i in self.scheduler.requests]
        if taken:
            raise ValueError(f"request_id {request_id!r} cannot be used with n={params.n}: the id {taken[0]!r} of "
                             f"one of its samples is already in use")
        group = SampleGroup(request_id, prompt, prompt_token_ids, num_unfinished=params.n)
        for i, (sample_id, seed) in enumerate(zip(ids, sample_seeds(params.seed, params.n, self._rng))):
            t = self._track(sample_id, prompt_token_ids, params, prompt, seed)
            t.group, t.index = group, i
            group.samples.append(t)
        bs = self.kv.block_size
        num_shared = (len(prompt_token_ids) - 1) // bs * bs    # whole blocks, leaving a token to compute
        fork = PromptFork(group.samples[0].request, num_shared, params.n) if num_shared else None
        for t in group.samples:          # nothing here can fail: every id was checked above
            self.scheduler.add_request(t.request, fork)
            self._tracked[t.request.request_id] = t
        self._groups[request_id] = group
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request and drop every trace of it at once (its blocks are freed); the next `step()` returns its
        final output, with finish_reason "abort". Returns whether it was found unfinished."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            for t in group.samples:
                self._tracked.pop(t.request.request_id, None)
                self.scheduler.abort(t.request.request_id)
                if t.finish_reason is None:
                    t.finish_reason = "abort"
            group.num_unfinished = 0
            self._queue_group(group)
            return True
        t = self._tracked.get(request_id)
        if t is not None and t.group is not None:    # a sample: its whole request goes
            return self.abort(t.group.request_id)
        t = self._tracked.pop(request_id, None)
        found = self.scheduler.abort(request_id)
        if t is None:
            return found
        t.finish_reason = "abort"
        self._ready.append(self._output(t))
        return True

    def has_unfinished(self) -> bool:
        # a step in flight holds only running requests, which the scheduler counts; once they are all finished or
        # aborted its tokens are of no use, and a step drops them (at once when the last request ends in a step)
        return self.scheduler.has_unfinished() or bool(self._ready) or bool(self._ready_groups)

    def num_tracked(self) -> int:
        """How many requests the engine holds output state for (those added and not yet finished or aborted); a
        request with n > 1 counts once, and once more for each of its unfinished samples."""
        return len(self._tracked) + len(self._groups)

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self, stream: bool = False) -> list[RequestOutput]:
        """Advance every unfinished request by one step; returns the outputs of requests that finished, or with
        `stream` of every request that got a new token (building an output copies its tokens, so batch generation
        asks only for finished ones).

        With async scheduling the next step is scheduled and launched while the previous one still runs on the
        device, and the previous one's tokens are processed after: a call returns what the step before it
        produced. A request that stops (EOS, stop string) has then run one extra step, whose token is dropped."""
        start = time.perf_counter()
        waited_before = self.stats.device_wait_s
        try:
            return self._step(stream)
        finally:
            self.stats.host_s += time.perf_counter() - start - (self.stats.device_wait_s - waited_before)

    def _step(self, stream: bool) -> list[RequestOutput]:
        # every output made goes to self._ready first, so that a failure later in the call loses none of them
        if self._structured is not None:
            self._fail_grammars()
        with section("ember.schedule"):
            out = self.scheduler.schedule()
        if out.is_empty:
            if out.step.finished_ids:     # the runner drops their rows
                self.runner.update_table(out.step)
            if self._in_flight is not None:
                self._resolve(stream)
            elif self._structured is not None:
                self._structured.wait_for_compiles()    # nothing to run until a grammar is ready: no busy loop
            return self._end_step()
        try:
            if out.step.grammar_rows:
                launched = self.structured.launch(self.runner, out, self._in_flight, self.stats)
            else:
                launched = self.runner.execute_async(out.step)
        except Exception as e:
            # the runner may not have dropped these rows yet; dropping one twice is harmless
            self.scheduler.requeue_finished_ids(out.step.finished_ids)
            raise self._fail([s.request for s in out.scheduled], e) from e
        # the new step is in flight before the previous one is processed, so that a failure there loses neither
        previous, self._in_flight = self._in_flight, LaunchedStep(out, launched)
        if previous is not None:
            self._process(previous, stream)
        if not self.config.scheduler.async_scheduling or not self.scheduler.has_unfinished():
            # sync; or every request of the step in flight has ended: drop its tokens now rather than hold it
            self._resolve(stream)
        return self._end_step()

    def _end_step(self) -> list[RequestOutput]:
        if self._in_flight is None and not self.scheduler.has_unfinished():
            # nothing left to run: the runner drops the rows of requests that just ended now, not at a later step
            finished_ids = self.scheduler.take_finished_ids()
            if finished_ids:
                self.runner.update_table(StepInput(finished_ids=finished_ids))
            stats = self.stats
            if stats.num_draft_tokens != self._logged_drafts:     # speculation's figures, once a batch is done
                self._logged_drafts = stats.num_draft_tokens
                logger.info("speculative decoding: %s", ", ".join(f"{k.replace('_', ' ')} {v:.3f}"
                                                                  for k, v in stats.spec_summary().items()))
        return self._take_ready()

    def _take_ready(self) -> list[RequestOutput]:
        ready, self._ready = self._ready, []
        if self._ready_groups:
            groups, self._ready_groups = self._ready_groups, []
            for group in groups:
                group.queued = False
                ready.append(self._group_output(group))
        return ready

    def _fail(self, requests: list[Request], error: BaseException) -> EngineStepError:
        """Abort the requests of a failed step that are still unfinished; the error to raise names them."""
        failed = []
        for req in requests:
            t = self._tracked.get(req.request_id)
            if t is not None and t.request is req:    # not finished, aborted or replaced under the same id
                request_id = t.group.request_id if t.group is not None else req.request_id
                self.abort(request_id)       # every sample of a request with n > 1
                failed.append(request_id)
        logger.error("a step failed (%s: %s); aborted requests %s", type(error).__name__, error, failed)
        return EngineStepError(failed, error)

    def _resolve(self, stream: bool) -> None:
        """Wait for the step in flight and process its tokens."""
        step, self._in_flight = self._in_flight, None
        self._process(step, stream)

    def _process(self, step: LaunchedStep, stream: bool) -> None:
        """Wait for a launched step and process its tokens; a failure aborts the step's requests."""
        out = step.out
        start = time.perf_counter()
        try:
            result = step.handle.result()
        except Exception as e:
            raise self._fail([s.request for s in out.scheduled], e) from e
        self.stats.device_wait_s += time.perf_counter() - start
        with section("ember.update"):
            if out.step.grammar_rows and not step.grammar_advanced:
                step.grammar_advanced = True
                self.structured.advance(out, result.sampled_token_ids)
            self._update(out, result, stream)

    def _fail_grammars(self) -> None:
        """End requests whose grammar failed to compile (the error names them)."""
        failed = self._structured.take_failed()
        if failed:
            error = failed[0][1]
            raise self._fail([req for req, _ in failed], error) from error

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput, stream: bool) -> None:
        try:
            updated = self.scheduler.update(out, result.sampled_token_ids, result.spec_token_ids)
        except Exception as e:
            raise self._fail([s.request for s in out.scheduled], e) from e
        tracked = self._tracked
        failed, error = [], None
        for req, row in updated:
            # one request's failure (a tokenizer error, say) aborts that request only
            try:
                t = tracked[req.request_id]
                if result.spec_token_ids is not None and result.spec_token_ids[row]:
                    self._update_run(t, result, row, stream)
                    continue
                if t.plain:
                    # the common token: no stop id, room left; its text waits until someone reads the output
                    token = req.output_token_ids[-1]
                    if token not in t.stop_ids and len(req.output_token_ids) < req.max_tokens:
                        t.detokenizer.add(token)
                        if stream:
                            if t.group is None:
                                self._ready.append(self._output(t))
                            else:
                                self._queue_group(t.group)
                        continue
                self._record_logprobs(t, result, row * result.logprob_stride)
                self._check_stop(t)
                if t.group is not None:
                    self._sample_updated(t, stream)
                elif stream or t.finish_reason is not None:
                    self._ready.append(self._output(t))
                if t.finish_reason is not None:
                    del tracked[req.request_id]
            except Exception as e:
                failed.append(req)
                error = e
        if failed:
            raise self._fail(failed, error) from error

    def _update_run(self, t: _Tracked, result: ModelRunnerOutput, row: int, stream: bool) -> None:
        """A verify step's row emitted several tokens (appended by the scheduler): take them back and add them one
        at a time, so that a stop token, stop string or max_tokens ends the output there and nothing after it."""
        req = t.request
        run = req.output_token_ids[-1 - len(result.spec_token_ids[row]):]
        del req.output_token_ids[-len(run):]
        for j, token in enumerate(run):
            req.output_token_ids.append(token)
            self._record_logprobs(t, result, row * result.logprob_stride + j)
            self._check_stop(t)
            if t.finish_reason is not None:
                break
        if t.group is not None:
            self._sample_updated(t, stream)
        elif stream or t.finish_reason is not None:
            self._ready.append(self._output(t))
        if t.finish_reason is not None:
            del self._tracked[req.request_id]

    def _record_logprobs(self, t: _Tracked, result: ModelRunnerOutput, row: int) -> None:
        n = t.request.sampling_params.logprobs
        if n is None or result.logprobs is None:
            return
        ids, lps = result.logprob_token_ids[row], result.logprobs[row]
        entry = {ids[0]: Logprob(lps[0], result.ranks[row])}
        for rank, (tok, lp) in enumerate(zip(ids[1:1 + n], lps[1:1 + n]), start=1):
            entry.setdefault(tok, Logprob(lp, rank))
        if self.tokenizer is not None:
            for tok, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tok])
        t.logprobs.append(entry)
        t.cumulative_logprob += lps[0]

    def _check_stop(self, t: _Tracked) -> None:
        req, p = t.request, t.request.sampling_params
        token = req.output_token_ids[-1]
        num_out = len(req.output_token_ids)
        may_stop = num_out >= p.min_tokens
        stop_token = may_stop and token in t.stop_ids
        # as in vLLM, a stop token's text is left out of the text unless include_stop_str_in_output asks for it;
        # stop strings are looked for only once min_tokens is reached, so one that ends earlier is never cut
        stop_str = t.detokenizer.add(token, add_text=not stop_token or p.include_stop_str_in_output,
                                     check_stop=may_stop)
        status = None
        if stop_token:
            status = RequestStatus.FINISHED_STOPPED
            t.stop_reason = token if token in p.stop_token_ids else None
        elif stop_str is not None:
            status, t.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif req.grammar is not None and req.grammar.terminated:
            # complete (nothing but EOS may follow), or the grammar refused the token
            status = RequestStatus.FINISHED_STOPPED if req.grammar.error is None else RequestStatus.FINISHED_ABORTED
        if status is None and (num_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            t.finish_reason = status.value
            self.scheduler.finish(req, status)

    def _sample_updated(self, t: _Tracked, stream: bool) -> None:
        """A sample got a token: its request's output is made once per step when streaming, and once at the end
        (when its last sample finishes) otherwise."""
        group = t.group
        if t.finish_reason is not None:
            group.num_unfinished -= 1
            if group.num_unfinished == 0:
                del self._groups[group.request_id]
        if stream or group.num_unfinished == 0:
            self._queue_group(group)

    def _queue_group(self, group: SampleGroup) -> None:
        if not group.queued:
            group.queued = True
            self._ready_groups.append(group)

    def _completion(self, t: _Tracked) -> CompletionOutput:
        return CompletionOutput(t.index, t.detokenizer.output_text(t.finish_reason is not None),
                                list(t.request.output_token_ids), t.cumulative_logprob,
                                list(t.logprobs) if t.logprobs is not None else None,
                                t.finish_reason, t.stop_reason)

    def _output(self, t: _Tracked) -> RequestOutput:
        req = t.request
        return RequestOutput(req.request_id, t.prompt, req.prompt_token_ids, [self._completion(t)],
                             t.finish_reason is not None, req.num_cached_prompt_tokens)

    def _group_output(self, group: SampleGroup) -> RequestOutput:
        """One output with every sample's completion, in index order; the cached-token count is the first
        sample's (the others start from its blocks)."""
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             [self._completion(t) for t in group.samples], group.num_unfinished == 0,
                             group.samples[0].request.num_cached_prompt_tokens)

    def score(self, token_ids: list[int]) -> "torch.Tensor":
        """Teacher-forced logits [len(token_ids), V] of one sequence, computed through the paged cache in one
        prefill step. Runs only while no other request is in flight."""
        if self.has_unfinished():
            raise RuntimeError("score() needs an idle engine; finish or abort running requests first")
        self.validate(token_ids, SamplingParams())
        if len(token_ids) > self.config.scheduler.max_num_batched_tokens:
            raise ValueError(f"{len(token_ids)} tokens exceed max_num_batched_tokens "
                             f"{self.config.scheduler.max_num_batched_tokens} for one scoring step")
        req = Request("__score__", list(token_ids), SamplingParams())
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
            return self.runner.all_logits(step)
        finally:
            self.kv.free(req)

    @property
    def stats(self):
        return self.scheduler.stats


def token_id_list(ids) -> list[int]:
    """A prompt's token ids as a list of Python ints; numpy and torch integers count (TypeError otherwise)."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"prompt_token_ids must be a list of int, got {type(ids).__name__} {ids!r}")
    return [as_int("prompt_token_ids entry", t) for t in ids]
