"""The standard benchmark workloads, as data: the nano-vllm throughput workload (full, or scaled unless
EMBER_BENCH_FULL=1), the batch-1 decode-latency shape, and the step-benchmark buckets."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ember.bench.workloads import Workload, random_workload


@dataclass(frozen=True)
class ThroughputSpec:
    """Parameters of a random-token throughput workload (lengths inclusive)."""
    name: str
    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def build(self, max_token_id: int = 10_000) -> Workload:
        """Draw the prompts and output lengths."""
        return random_workload(self.num_prompts, self.input_len, self.output_len, self.seed, max_token_id)


@dataclass(frozen=True)
class LatencySpec:
    """One batch decoded from arrival to its last token."""
    batch_size: int = 1
    input_len: int = 32
    output_len: int = 256


# nano-vllm's benchmark: 256 prompts, 100..1024 in and out, seed 0 -> 142,827 prompt and 133,966 output tokens
NANO_VLLM_THROUGHPUT = ThroughputSpec("nano-vllm", 256, (100, 1024), (100, 1024))
# the same shape of traffic, an eighth of the tokens: a few seconds on an H100
SCALED_THROUGHPUT = ThroughputSpec("nano-vllm-scaled", 64, (100, 512), (100, 512))

DECODE_LATENCY = LatencySpec(batch_size=1, input_len=32, output_len=256)

# decode batch sizes timed per step, and the context every request in them has already cached
STEP_BATCH_SIZES = (1, 8, 64, 256)
STEP_CONTEXT_LEN = 512
# a mixed step adds one prefill chunk of this many tokens after the decodes
STEP_PREFILL_LEN = 256


def full_run() -> bool:
    """Whether the full-size workloads were asked for (EMBER_BENCH_FULL=1)."""
    return os.environ.get("EMBER_BENCH_FULL", "0") not in ("", "0")


def throughput_spec() -> ThroughputSpec:
    """The full nano-vllm workload when asked for, else the scaled one."""
    return NANO_VLLM_THROUGHPUT if full_run() else SCALED_THROUGHPUT
