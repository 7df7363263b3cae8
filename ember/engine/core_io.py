"""What goes into the engine core and what comes out of it: plain data, the same in one process and across a
process boundary (`ember.engine.wire` encodes these types; nothing here imports a serializer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from ember.sampling_params import SamplingParams


class EngineCoreRequest(NamedTuple):
    """A request as the core takes it: validated token ids, how to sample them, and one seed per sample (the front
    end draws them, so that a request samples the same whichever core serves it). With `sampling_params.n > 1` the
    core runs the samples as requests `sample_request_id(request_id, i)` that share the prompt's blocks."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_seeds: tuple[int, ...]
    arrival_time: float = 0.0


class CoreInfo(NamedTuple):
    """What a started core tells its front end once: the limits requests are checked against, and its size."""
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int


class CoreStats(NamedTuple):
    """The core's load after its last step, and its counters since it started. `busy_s` is host time: the steps'
    wall time less their waits for the device, and (in a process of its own) the handling of messages.
    `num_requests` counts the requests it holds, `num_runner_rows` the runner's request-table rows; the device
    memory figures are torch's on CUDA (0 elsewhere) and `resident_memory` the core process's resident bytes (0 in
    the front end's process, whose own figure the server reports), refreshed at most once a second in a busy core
    process and at every send once it is idle."""
    num_running: int = 0
    num_waiting: int = 0
    num_blocks_used: int = 0
    num_blocks_total: int = 1
    num_steps: int = 0
    busy_s: float = 0.0
    step_s: float = 0.0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    num_requests: int = 0
    num_runner_rows: int = 0
    gpu_memory_allocated: int = 0
    gpu_memory_reserved: int = 0
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verified_requests: int = 0
    resident_memory: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total

    def spec_summary(self) -> dict[str, float]:
        """Speculative decoding's acceptance rate, mean acceptance length and tokens per step
        (`SchedulerStats.spec_summary`)."""
        return {"acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
                "mean_acceptance_length": 1 + self.num_accepted_tokens / max(self.num_verified_requests, 1),
                "tokens_per_step": self.num_generated_tokens / max(self.num_steps, 1)}


@dataclass(slots=True)
class EngineCoreOutputs:
    """What the core's steps produced since the front end last asked. `req_ids[i]` got the token
    `new_token_ids[i]`, in order (a request that got several, from a verify step or two steps, appears once for
    each; the columns are often a step's own lists: never change them, nor the lists in `logprobs`). The dicts
    are sparse, keyed by request id: `finished` holds (finish_reason, stop_reason, number of output tokens) of
    requests the core finished ("stop": a stop token, whose id is the stop_reason if it was one of
    `stop_token_ids`; "grammar": its structured output is complete; "abort": its grammar refused the token;
    "length"), `logprobs` a (token ids, logprobs, rank of the sampled token) per token for
    requests that asked (the sampled token first, then the most likely ones), `num_cached_tokens` the prefix-cache
    hits of requests admitted. `failed_ids` were aborted by a step that failed with `failure` (a message)."""
    req_ids: Sequence[str] = ()
    new_token_ids: Sequence[int] = ()
    finished: dict[str, tuple[str, int | None, int]] = field(default_factory=dict)
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    failed_ids: list[str] = field(default_factory=list)
    failure: str | None = None
    stats: CoreStats = CoreStats()
    cause: BaseException | None = None      # the failure's exception, in this process only (never sent)


class PromptLogprobData(NamedTuple):
    """Per prompt position after the first: the prompt token's logprob and rank, and the top tokens' ids and
    logprobs."""
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
