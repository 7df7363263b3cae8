"""The standard random-token workloads of `ember bench`: nano-vllm's draw order, length ranges and percentiles."""

from __future__ import annotations

import random
from dataclasses import dataclass

MAX_PROMPT_TOKEN_ID = 10000   # nano-vllm's throughput benchmark draws prompt ids in [0, 10000]


@dataclass(frozen=True)
class Workload:
    """Random-token prompts and the number of tokens to generate for each."""
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        """Prompt tokens over all requests."""
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        """Tokens asked for over all requests."""
        return sum(self.output_lens)


def parse_range(text: str) -> tuple[int, int]:
    """"100:1024" -> (100, 1024); "32" -> (32, 32). Bounds are inclusive and at least 1."""
    lo, _, hi = str(text).partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"length range {text!r} must be an integer or LOW:HIGH") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"length range {text!r} needs 1 <= LOW <= HIGH")
    return bounds


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int = 0,
                    max_token_id: int = MAX_PROMPT_TOKEN_ID) -> Workload:
    """nano-vllm's draw order: every prompt (its length, then its ids), then every output length."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts {num_prompts} must be at least 1")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(*input_len))] for _ in range(num_prompts)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(num_prompts)])


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    """{"p50": ..., "p90": ..., "p99": ...} with linear interpolation."""
    import numpy as np
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(np.asarray(values, dtype=np.float64), q)) for q in qs}
