"""`Request` (owned by the scheduler) and the vLLM-shaped outputs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ember.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A request as the scheduler sees it: all its tokens, how many have KV in the cache, its status. Two requests
    are equal only if they are the same object (finding one in the running list compares identities, not fields)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0          # tokens whose KV is written or being written by a step in flight
    num_pending: int = 0                  # tokens sampled by a step in flight, not yet in output_token_ids
    # async speculation: how many more tokens than `num_pending` the steps in flight may emit (their proposals)
    num_spec_slack: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0     # prefix-cache hits at the last admission
    stop_reason: int | str | None = None
    sampling_seed: int = 0                # sampling_params.seed, or one drawn from the engine's generator
    max_tokens: int = 16                  # resolved: sampling_params.max_tokens or what fits in max_model_len
    grammar: object | None = None         # structured output: its `RequestGrammar` (engine/structured_output.py)
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: stop_token_ids, and EOS unless ignore_eos

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]


@dataclass
class Logprob:
    """Log-probability of one token and its rank in the vocabulary (1 = most likely)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt, as in vLLM."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt, as in vLLM."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # with SamplingParams(prompt_logprobs=K): per prompt token, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
