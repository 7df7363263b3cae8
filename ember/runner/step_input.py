"""The contract between the scheduler and the runner: plain, frozen data, one `StepInput` per step.

A request arrives once, as a `NewRequest`, with everything the runner needs to keep it in its table. After that,
each step names it only by id and the start of its chunk, in the batch lists; a request that gained blocks is also
named in a `RunningRequest`, so the host work of a decode step grows only with what changed. A request
that finished, was aborted or was preempted is named once in `finished_ids`, and the runner drops its row; a
preempted request comes back later as a new request that carries the tokens it had already generated.

Block lists only grow at the end: `new_block_ids` are appended to the blocks the runner already holds for the
request, per KV-cache group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ember.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen (or has dropped since): its tokens, how to sample it, its blocks."""
    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    seed: int
    block_ids: tuple[tuple[int, ...], ...]     # per KV-cache group, every block the request holds
    num_computed_tokens: int                   # tokens whose KV is already in the cache (prefix-cache hits)
    output_token_ids: tuple[int, ...] = ()     # tokens generated before a preemption
    eos_token_ids: tuple[int, ...] = ()        # blocked while fewer than min_tokens tokens are out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True)
class RunningRequest:
    """A request already in the runner's table that gained blocks since the runner last heard of it."""
    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...]  # per KV-cache group, blocks appended since the last step


@dataclass(frozen=True)
class StepInput:
    """One step: the table changes, then the batch in order (decodes, i.e. single-token queries, first).

    `req_ids[i]` runs `num_scheduled_tokens[i]` tokens starting at `num_computed_tokens[i]`. A batch request is
    either new (in `new_requests`) or already in the table; the runner applies `finished_ids` before adding new rows.
    """
    new_requests: tuple[NewRequest, ...] = ()
    running_requests: tuple[RunningRequest, ...] = ()
    finished_ids: tuple[str, ...] = ()          # finished, aborted or preempted since the last step
    req_ids: tuple[str, ...] = ()
    num_scheduled_tokens: tuple[int, ...] = ()
    num_decodes: int = 0
    num_computed_tokens: tuple[int, ...] = ()   # per batch request, the start of its chunk
    # per batch request, the tokens proposed after its last one (ember.spec_decode), or () when the step has none;
    # a request with proposals runs its last token and them, and the step verifies them
    spec_token_ids: tuple[tuple[int, ...], ...] = ()
    # batch rows that sample under a grammar: the step's token bitmask has one row for each, in this order
    grammar_rows: tuple[int, ...] = ()
    # batch rows whose query starts at the request's last token wherever the device has it (async speculation: the
    # host learns a step's accepted count one step late); their `num_computed_tokens` is then an upper bound
    position_rows: tuple[int, ...] = ()
    # each position row with `device_drafts` + 1 query tokens runs its last token and as many proposals the device
    # makes (ember.spec_decode.device_verify)
    device_drafts: int = 0

    def __post_init__(self):
        if len(self.req_ids) != len(self.num_scheduled_tokens):
            raise ValueError(f"{len(self.req_ids)} request ids but {len(self.num_scheduled_tokens)} token counts")
        if len(self.num_computed_tokens) != len(self.req_ids):
            raise ValueError(f"{len(self.req_ids)} request ids but {len(self.num_computed_tokens)} chunk starts")
        if self.num_scheduled_tokens and min(self.num_scheduled_tokens) < 1:
            raise ValueError(f"every scheduled request runs at least one token, got {self.num_scheduled_tokens}")
        if self.spec_token_ids and len(self.spec_token_ids) != len(self.req_ids):
            raise ValueError(f"{len(self.req_ids)} request ids but {len(self.spec_token_ids)} proposal lists")

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.req_ids


def null_block_step(name: str, query_lens: Sequence[int], params: Sequence[SamplingParams], block_size: int,
                    num_groups: int, context_len: int = 0) -> StepInput:
    """A step of new requests `{name}_{i}` of token 0 whose blocks are all the null block 0 (warm-up, profiling and
    capture run these; the caller drops their rows afterwards), single-token queries leading the batch. With
    `context_len`, each request has that many tokens already computed before its query (as a prefix-cache hit
    would), so its attention reads that long a context (of the null block's bytes)."""
    if context_len < 0:
        raise ValueError(f"context_len {context_len} must be non-negative")
    new = tuple(NewRequest(f"{name}_{r}", (0,) * (context_len + n), p, 0,
                           ((0,) * -(-(context_len + n) // block_size),) * num_groups, context_len)
                for r, (n, p) in enumerate(zip(query_lens, params)))
    order = sorted(range(len(new)), key=lambda r: query_lens[r] != 1)
    return StepInput(new_requests=new, req_ids=tuple(new[r].req_id for r in order),
                     num_scheduled_tokens=tuple(query_lens[r] for r in order),
                     num_decodes=sum(1 for n in query_lens if n == 1),
                     num_computed_tokens=(context_len,) * len(new))
