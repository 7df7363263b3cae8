"""The front end's half of the engine: per request, its text (incremental detokenization), stop strings, logprobs as
vLLM-shaped entries, the samples of a request with n > 1, and its `RequestOutput`. It reads the engine core's
token-level outputs (`EngineCoreOutputs`) and never touches the scheduler: a request whose stop string matched is
named back to the caller, which finishes it in the core.

A request runs in the core under a core id: its own id in the same process, a unique one behind a process
boundary (an id may be reused there while the core still runs the old request). The samples of a request with
n > 1 run as `sample_request_id(core_id, i)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.engine.core_io import EngineCoreOutputs
from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.request import CompletionOutput, Logprob, RequestOutput
from ember.engine.sample_group import SampleGroup, sample_request_id
from ember.sampling_params import SamplingParams


@dataclass(eq=False)
class RequestState:
    """One request's (or one sample's) output beyond what the core knows: its tokens, text and logprobs."""
    request_id: str                 # the id its outputs carry (a sample's: its request's)
    core_id: str                    # the id the core runs it under
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # a token that ends nothing needs no more than an append: no logprobs to record, no stop string to look for
    plain: bool = False
    token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    group: SampleGroup | None = None      # one of n > 1 samples: its output is the group's
    index: int = 0                        # its index among them
    queued: bool = False                  # its output is already due from the outputs being processed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Tracks unfinished requests by core id, turns the core's outputs into their state, and makes their
    `RequestOutput`s."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}      # unfinished requests and samples, by core id
        self.groups: dict[str, SampleGroup] = {}       # unfinished requests with n > 1, by request id
        self.core_ids: dict[str, str] = {}             # unfinished requests' core ids, by request id

    def __len__(self) -> int:
        """Requests held (added and not yet finished or aborted); a request with n > 1 counts once, and once more
        for each of its unfinished samples."""
        return len(self.states) + len(self.groups)

    def check_id(self, request_id: str, n: int) -> None:
        """ValueError if `request_id` (or, with n > 1, the id of one of its samples) is in use."""
        if request_id in self.core_ids or request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if n > 1:
            taken = [i for i in (sample_request_id(request_id, k) for k in range(n))
                     if i in self.core_ids or i in self.states]
            if taken:
                raise ValueError(f"request_id {request_id!r} cannot be used with n={n}: the id {taken[0]!r} of "
                                 f"one of its samples is already in use")

    def make(self, request_id: str, core_id: str, prompt_token_ids: list[int], params: SamplingParams,
             prompt: str | None) -> RequestState | SampleGroup:
        """The state of a new request (a group of states with n > 1); `register` it once the core has it."""
        if params.n == 1:
            return self._state(request_id, core_id, prompt_token_ids, params, prompt)
        group = SampleGroup(request_id, prompt, prompt_token_ids, num_unfinished=params.n)
        for i in range(params.n):
            state = self._state(request_id, sample_request_id(core_id, i), prompt_token_ids, params, prompt)
            state.group, state.index = group, i
            group.samples.append(state)
        group.core_id = core_id
        return group

    def _state(self, request_id, core_id, prompt_token_ids, params, prompt) -> RequestState:
        token_ids: list[int] = []      # the detokenizer reads the tokens where the state keeps them
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                       params.include_stop_str_in_output, output_ids=token_ids)
        wants = params.logprobs is not None
        return RequestState(request_id, core_id, prompt, prompt_token_ids, params, detok, [] if wants else None,
                            0.0 if wants else None, plain=not wants and not params.stop, token_ids=token_ids)

    def register(self, item: RequestState | SampleGroup) -> None:
        if isinstance(item, SampleGroup):
            for state in item.samples:
                self.states[state.core_id] = state
            self.groups[item.request_id] = item
            self.core_ids[item.request_id] = item.core_id
        else:
            self.states[item.core_id] = item
            self.core_ids[item.request_id] = item.core_id

    # ---- the core's outputs ----------------------------------------------------------------------------------
    def process(self, out: EngineCoreOutputs, stream: bool) -> tuple[list, list[str], list]:
        """Apply one batch of core outputs. Returns the requests (states, or groups for n > 1) whose output is
        due (every one that changed with `stream`, else the finished ones), the core ids whose stop string
        matched (the caller finishes them in the core), and (state, exception) of requests whose processing
        failed (the caller aborts them)."""
        states = self.states
        for core_id, num_cached in out.num_cached_tokens.items():
            state = states.get(core_id)
            if state is not None:
                state.num_cached_tokens = num_cached
        due, stopped, failed = [], [], []
        finished, logprobs = out.finished, out.logprobs
        taken: dict[str, int] = {}          # logprobs entries used so far, by request
        for core_id, token in zip(out.req_ids, out.new_token_ids):
            state = states.get(core_id)
            if state is None:
                continue        # finished or aborted here while the core ran its step
            # one request's failure (a tokenizer error) is its own: the caller aborts that request only
            try:
                state.token_ids.append(token)
                if state.plain and core_id not in finished:
                    # the common token: its text waits in the detokenizer's view of token_ids until someone reads
                    # the output
                    if stream:
                        item = state if state.group is None else state.group
                        if not item.queued:         # a request may have several tokens in one batch
                            item.queued = True
                            due.append(item)
                    continue
                core_finish = finished.get(core_id)
                if core_finish is not None and core_finish[2] != len(state.token_ids):
                    core_finish = None          # the request's last token of these outputs is still to come
                entry = None
                if core_id in logprobs:         # one entry per token, in order
                    k = taken.get(core_id, 0)
                    entry, taken[core_id] = logprobs[core_id][k], k + 1
                self._update(state, token, core_finish, entry, stopped)
            except Exception as e:      # noqa: BLE001
                failed.append((state, e))
                continue
            group = state.group
            if state.finish_reason is not None:
                del states[core_id]
                if group is None:
                    del self.core_ids[state.request_id]
                else:
                    group.num_unfinished -= 1
                    if group.num_unfinished == 0:
                        del self.groups[group.request_id]
                        del self.core_ids[group.request_id]
            item = state if group is None else group
            if (stream or item.finished) and not item.queued:
                item.queued = True
                due.append(item)
        for item in due:
            item.queued = False
        return due, stopped, failed

    def _update(self, state: RequestState, token: int, core_finish, logprobs, stopped: list[str]) -> None:
        p = state.params
        if logprobs is not None and state.logprobs is not None:
            self._record_logprobs(state, *logprobs)
        stop_token = core_finish is not None and core_finish[0] == "stop"
        # as in vLLM, a stop token's text is left out of the text unless include_stop_str_in_output asks for it;
        # stop strings are looked for only once min_tokens is reached, so one that ends earlier is never cut
        stop_str = state.detokenizer.add(token, add_text=not stop_token or p.include_stop_str_in_output,
                                         check_stop=len(state.token_ids) >= p.min_tokens)
        if stop_token:
            state.finish_reason, state.stop_reason = "stop", core_finish[1]
        elif stop_str is not None:
            state.finish_reason, state.stop_reason = "stop", stop_str
            if core_finish is None:
                stopped.append(state.core_id)
        elif core_finish is not None:     # "length"; "grammar" (complete) is a stop; "abort" (refused a token)
            state.finish_reason = "stop" if core_finish[0] == "grammar" else core_finish[0]

    def _record_logprobs(self, state: RequestState, ids: list[int], lps: list[float], rank: int) -> None:
        entry = {ids[0]: Logprob(lps[0], rank)}
        for r, (tok, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            entry.setdefault(tok, Logprob(lp, r))
        if self.tokenizer is not None:
            for tok, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tok])
        state.logprobs.append(entry)
        state.cumulative_logprob += lps[0]

    # ---- ending requests -------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> tuple[list[str], RequestState | SampleGroup | None]:
        """Drop an unfinished request (every sample of it; a sample's id stands for its request) and mark it
        aborted. Returns the core ids to abort in the core and the request, whose final output is due; ([], None)
        if it is not held."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            del self.core_ids[request_id]
            core_ids = []
            for state in group.samples:
                if self.states.pop(state.core_id, None) is not None:
                    core_ids.append(state.core_id)
                if state.finish_reason is None:
                    state.finish_reason = "abort"
            group.num_unfinished = 0
            return core_ids, group
        core_id = self.core_ids.get(request_id, request_id)
        state = self.states.get(core_id)
        if state is None:
            return [], None
        if state.group is not None:         # a sample: its whole request goes
            return self.abort(state.group.request_id)
        del self.states[core_id]
        del self.core_ids[request_id]
        state.finish_reason = "abort"
        return [core_id], state

    # ---- outputs ---------------------------------------------------------------------------------------------
    def output(self, item: RequestState | SampleGroup) -> RequestOutput:
        """The cumulative output of a request (of every sample, in index order, for n > 1)."""
        if isinstance(item, SampleGroup):
            # the cached-token count is the first sample's (the others start from its blocks)
            return RequestOutput(item.request_id, item.prompt, item.prompt_token_ids,
                                 [self.completion(s) for s in item.samples], item.num_unfinished == 0,
                                 item.samples[0].num_cached_tokens)
        return RequestOutput(item.request_id, item.prompt, item.prompt_token_ids, [self.completion(item)],
                             item.finish_reason is not None, item.num_cached_tokens)

    @staticmethod
    def completion(state: RequestState) -> CompletionOutput:
        return CompletionOutput(state.index, state.detokenizer.output_text(state.finish_reason is not None),
                                list(state.token_ids), state.cumulative_logprob,
                                list(state.logprobs) if state.logprobs is not None else None,
                                state.finish_reason, state.stop_reason)


def prompt_logprob_entries(token_ids: list[int], data, tokenizer) -> list[dict[int, Logprob] | None]:
    """[None, {token: Logprob, ...}, ...]: one entry per prompt token from the core's `PromptLogprobData`; each holds
    the token itself (with its rank) and the most likely tokens at that position, decoded where there is a
    tokenizer."""
    entries: list[dict[int, Logprob] | None] = [None]
    for i, token in enumerate(token_ids[1:]):
        entry = {token: Logprob(data.logprobs[i], data.ranks[i])}
        for rank, (t, lp) in enumerate(zip(data.top_ids[i], data.top_logprobs[i]), start=1):
            entry.setdefault(t, Logprob(lp, rank))
        if tokenizer is not None:
            for t, logprob in entry.items():
                logprob.decoded_token = tokenizer.decode([t])
        entries.append(entry)
    return entries
