"""A soak of `ember serve --config qwen3-0.6b` (random weights, default settings) on one GPU: 20,000 short requests,
streamed and whole, at most 64 at a time, 10% of the clients leaving mid-stream and 5% sending malformed JSON.
Prints the GPU memory torch holds and the resident memory of the server's two processes (the front end, the engine
core) at start (before the first request), after the first 2,000 requests and at the end; checks that every request
got its answer or its error, that nothing is held once idle, that the device memory allocated at the end is no more
than after the first 2,000 requests, and that each process's resident memory at the end is within 5% of its value
then.

    PYTHONPATH=. python -m pytest -q -s -m "gpu and slow" tests/gpu/test_serve_soak_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.soak import DISCONNECT, MALFORMED, RESIDENT, ember_serve, kind_of, metrics, send, total, wait_idle

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_REQUESTS, FIRST = 20_000, 2_000
MiB = 2 ** 20


def _memory(values: dict) -> str:
    return (f"GPU allocated {total(values, 'ember_gpu_memory_allocated_bytes') / MiB:.0f} MiB, reserved "
            f"{total(values, 'ember_gpu_memory_reserved_bytes') / MiB:.0f} MiB; resident: "
            + ", ".join(f"{name} {values[key] / MiB:.0f} MiB" for name, key in RESIDENT.items()))


def test_20000_requests_leave_nothing_held_and_memory_flat(tmp_path):
    args = ["--config", "qwen3-0.6b", "--served-model-name", "soak"]
    with ember_serve(args, tmp_path / "serve.log") as (url, _):
        at_start = metrics(url)
        start = time.monotonic()
        first = send(url, range(FIRST), text=False, chat=False)
        after_first = wait_idle(url)
        rest = send(url, range(FIRST, NUM_REQUESTS), text=False, chat=False)
        at_end = wait_idle(url)
        seconds = time.monotonic() - start
    kinds = [kind_of(i, chat=False) for i in range(NUM_REQUESTS)]
    counts = {k: getattr(first, k) + getattr(rest, k) for k in ("answered", "errors", "disconnected")}
    finished = total(at_end, "ember_request_success_total", finished_reason="length")
    print(f"\n{NUM_REQUESTS} requests in {seconds:.0f} s: {counts}; finished with 'length': {finished:.0f}")
    for label, values in (("at start", at_start), (f"after {FIRST}", after_first), ("at the end", at_end)):
        print(f"{label}: {_memory(values)}")
    assert first.wrong + rest.wrong == []
    assert counts == {"answered": NUM_REQUESTS - kinds.count(DISCONNECT) - kinds.count(MALFORMED),
                      "errors": kinds.count(MALFORMED), "disconnected": kinds.count(DISCONNECT)}
    # what the first requests allocated on first use stays; nothing grows after them
    assert total(at_end, "ember_gpu_memory_allocated_bytes") <= total(after_first, "ember_gpu_memory_allocated_bytes")
    for name, key in RESIDENT.items():
        rss_first, rss_end = after_first[key], at_end[key]
        assert rss_first > 0, f"no {name} resident memory in the metrics"
        assert abs(rss_end - rss_first) <= 0.05 * rss_first, name
