"""A draft model proposer: a second, smaller model of the target's vocabulary, run by a `ModelRunner` of its own
(its own weights, KV cache, request table and graphs), proposes each request's next k tokens greedily.

Each step, for the requests the scheduler may speculate on: the draft catches up on the tokens it has not run
(those the target emitted since, a short prefill starting at the longest prefix its cache still holds), which
samples the first proposal, then runs k - 1 single-token decode steps, each sampling the next. A greedy draft is a
deterministic proposer, so the verify step's rejection sampling (q one-hot at the proposal) keeps the target's
distribution exactly. The KV of proposals the target rejected is overwritten by the next catch-up, as the
target's is."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ember.runner.step_input import NewRequest, StepInput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
# draft steps launched and not yet read back at most: the runner's ring of pinned host buffers holds 4 steps' tokens
_IN_FLIGHT = 3
# strings whose token ids must be the same under the target's and the draft's tokenizers
PROBE_STRINGS = ("Hello, world!", "The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2\n",
                 "  12345 67.89e-3 \u00e9\u00e8\u00ea \u4f60\u597d \U0001f600", "<|endoftext|> </s> <s>")


@dataclass
class _DraftState:
    """What the draft's cache holds for one request: the tokens whose KV it has, and its blocks."""
    fed: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


@dataclass
class _Job:
    req_id: str
    tokens: list[int]
    limit: int
    start: int                  # tokens [0, start) have their KV in the draft's cache
    state: _DraftState
    proposals: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Proposes for a batch of requests at once (`propose_batch`); the scheduler calls `drop` when a request
    leaves (finished, aborted or preempted), which frees its blocks of the draft's cache."""

    def __init__(self, runner, num_speculative_tokens: int):
        check_groups(runner)
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_size = runner.config.cache.block_size
        self._free = list(range(runner.num_blocks - 1, 0, -1))     # block 0 is the null block
        self._states: dict[str, _DraftState] = {}
        self._in_flight: deque = deque()       # (the job taking each batch row's token or None, launched output)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def drop(self, req_id: str) -> None:
        """Forget a request: its blocks go back to the draft's pool."""
        state = self._states.pop(req_id, None)
        if state is not None:
            self._free.extend(state.blocks)

    def propose_batch(self, wanted: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, tuple[int, ...]]:
        """Proposals for (request id, its prompt and output tokens, at most how many) triples: up to
        min(k, limit) greedy tokens each. A request the draft's cache has no room for gets none this step."""
        jobs = []
        for req_id, tokens, limit in wanted[:self.runner.max_num_reqs]:
            limit = min(limit, self.k)
            if limit < 1:
                continue
            state = self._states.setdefault(req_id, _DraftState())
            tokens = list(tokens)
            start = min(_common_prefix(state.fed, tokens), len(tokens) - 1)
            need = -(-(len(tokens) + limit - 1) // self.block_size)     # the last proposal's KV is never written
            if need > len(state.blocks):
                if need - len(state.blocks) > len(self._free):
                    continue
                state.blocks.extend(self._free.pop() for _ in range(need - len(state.blocks)))
            jobs.append(_Job(req_id, tokens, limit, start, state))
        if not jobs:
            return {}
        runner = self.runner
        self._catch_up(jobs)
        # each decode step reads the token the step before sampled from the table on the device, so the steps are
        # launched without waiting for their tokens (read back a few steps behind, and all at the end)
        for j in range(1, max(job.limit for job in jobs)):
            batch = [job for job in jobs if job.limit > j]
            self._launch(StepInput(req_ids=tuple(job.req_id for job in batch),
                                   num_scheduled_tokens=(1,) * len(batch), num_decodes=len(batch),
                                   num_computed_tokens=tuple(len(job.tokens) + j - 1 for job in batch)), batch)
        while self._in_flight:
            self._land()
        # the rows go; the cache's blocks stay with the request until `drop`
        runner.update_table(StepInput(finished_ids=tuple(job.req_id for job in jobs)))
        for job in jobs:
            job.state.fed = job.tokens + job.proposals[:-1]
        return {job.req_id: tuple(job.proposals) for job in jobs}

    def _catch_up(self, jobs: list[_Job]) -> None:
        """Run each job's tokens from its `start` on, in steps of at most the runner's token budget (each request
        arrives as a new row whose first `start` tokens count as cached); the step that reaches a request's last
        token samples its first proposal."""
        runner = self.runner
        new = tuple(NewRequest(job.req_id, tuple(job.tokens), _GREEDY, 0, (tuple(job.state.blocks),), job.start)
                    for job in jobs)
        done = {job.req_id: job.start for job in jobs}
        pending = list(jobs)
        while pending:
            budget, batch = runner.max_num_tokens, []
            for job in pending:
                n = min(len(job.tokens) - done[job.req_id], budget)
                if n < 1:
                    break
                batch.append((job, n))
                budget -= n
            batch.sort(key=lambda b: b[1] != 1)     # single-token queries lead the batch
            step = StepInput(
                new_requests=new, req_ids=tuple(job.req_id for job, _ in batch),
                num_scheduled_tokens=tuple(n for _, n in batch), num_decodes=sum(1 for _, n in batch if n == 1),
                num_computed_tokens=tuple(done[job.req_id] for job, _ in batch))
            new = ()
            for job, n in batch:
                done[job.req_id] += n
            # a row part-way through its tokens samples a token nobody reads
            self._launch(step, [job if done[job.req_id] == len(job.tokens) else None for job, _ in batch])
            pending = [job for job in pending if done[job.req_id] < len(job.tokens)]

    def _launch(self, step: StepInput, receivers: list) -> None:
        """Launch a draft step; `receivers[i]` is the job that takes batch row i's token (None: no one)."""
        while len(self._in_flight) >= _IN_FLIGHT:
            self._land()
        self._in_flight.append((receivers, self.runner.execute_async(step)))

    def _land(self) -> None:
        """Read back the oldest launched step's tokens (waiting for them) and hand them to their jobs."""
        receivers, out = self._in_flight.popleft()
        for job, token in zip(receivers, out.result().sampled_token_ids):
            if job is not None:
                job.proposals.append(int(token))


def check_groups(runner) -> None:
    """Refuse a draft runner of more than one KV-cache group: the draft's pool hands out blocks of one group."""
    if len(runner.attn.groups) != 1:
        raise ValueError(f"the draft model has {len(runner.attn.groups)} KV-cache groups (sliding-window or "
                         f"hybrid layers); a draft model of one group (full attention in every layer) is supported")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def build_draft_proposer(config, load_format: str, target, tokenizer=None):
    """The draft model of `config.speculative` on the target's device, dtype, load format and limits, after the
    checks that it can draft for `target` (the target's runner or executor): the same vocabulary size, the same
    token ids for `PROBE_STRINGS` where both have tokenizers, a context at least the target's max_model_len.
    Under async scheduling a `DeviceDraftProposer`, which the target's `DeviceVerifier` runs each step; else a
    `DraftModelProposer`, which the scheduler asks before each step."""
    from ember.models.loader import load_config
    from ember.runner.model_runner import ModelRunner
    spec = config.speculative
    name = spec.model
    if Path(name).is_dir():
        path, hf_config = Path(name), load_config(name)
    elif load_format == "dummy":
        from ember.models.bundled import bundled_config
        path, hf_config = Path(name), bundled_config(name)
    else:
        raise ValueError(f"speculative_config model {name!r} is not a folder; give the draft model's folder (with "
                         f"load_format='dummy', a bundled config name)")
    check_draft(hf_config, path, target.vocab_size, target.max_model_len, tokenizer)
    draft_config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, model=str(path), max_model_len=target.max_model_len),
        speculative=None)
    logger.info("draft model %s: a cache of its own, sized as the target's is (docs/spec_decode.md)", name)
    runner = ModelRunner(draft_config, str(path), hf_config, load_format)
    if not config.scheduler.async_scheduling:
        return DraftModelProposer(runner, spec.num_speculative_tokens)
    from ember.spec_decode.draft_device import DeviceDraftProposer
    proposer = DeviceDraftProposer(runner, spec.num_speculative_tokens)
    target.verifier.draft = proposer
    return proposer


def check_draft(hf_config, path: Path, vocab_size: int, max_model_len: int, tokenizer=None) -> None:
    """Refuse (ValueError, with the reason) a draft that cannot propose for this target."""
    draft_vocab = getattr(hf_config, "vocab_size", None)
    if draft_vocab != vocab_size:
        raise ValueError(f"the draft model {str(path)!r} has a vocabulary of {draft_vocab} tokens and the target "
                         f"{vocab_size}; a draft must share the target's tokenizer")
    draft_len = int(getattr(hf_config, "max_position_embeddings", 0) or 1 << 20)
    if draft_len < max_model_len:
        raise ValueError(f"the draft model {str(path)!r} allows {draft_len} positions and the target runs requests "
                         f"of up to max_model_len {max_model_len}; lower max_model_len to {draft_len} or pick a "
                         f"draft with a longer context")
    if tokenizer is None or not path.is_dir() or not any(
            (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return
    from transformers import AutoTokenizer
    draft_tokenizer = AutoTokenizer.from_pretrained(str(path))
    for text in PROBE_STRINGS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        draft_ids = draft_tokenizer.encode(text, add_special_tokens=False)
        if list(ids) != list(draft_ids):
            raise ValueError(f"the draft model {str(path)!r} tokenizes {text!r} as {list(draft_ids)} and the target "
                             f"as {list(ids)}; a draft must share the target's tokenizer")
