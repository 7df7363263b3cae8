"""Parallel sampling on the engine's side: the n samples of one request, their ids and seeds, and the one output
that carries them all (`RequestOutput.outputs[i]` is sample i)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SEED_RANGE = 2**63


def sample_request_id(request_id: str, index: int) -> str:
    """The id under which sample `index` of request `request_id` runs in the scheduler and the runner."""
    return f"{request_id}#sample{index}"


def sample_seeds(seed: int | None, n: int, rng: random.Random) -> list[int]:
    """One seed per sample: `(seed + i) % 2**63` for sample i when the request has a seed, so that sample i
    equals a request of n=1 with that seed; otherwise each is drawn from the engine's generator in turn."""
    if seed is None:
        return [rng.getrandbits(63) for _ in range(n)]
    return [(seed + i) % SEED_RANGE for i in range(n)]


@dataclass
class SampleGroup:
    """The samples of one request with n > 1, under the request's own id; finished when all of them are."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list = field(default_factory=list)   # the front end's per-sample state, sample i at index i
    num_unfinished: int = 0
    queued: bool = False     # its output is already due from the outputs being processed (once per batch)
    core_id: str = ""        # the id the core runs it under; sample i runs as sample_request_id(core_id, i)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0
