"""A soak of `ember serve --config qwen3-0.6b` (random weights, default settings) on one GPU: 20,000 short requests,
streamed and whole, at most 64 at a time, 10% of the clients leaving mid-stream and 5% sending malformed JSON.
Prints the GPU memory torch holds and the resident memory of the server's two processes (the front end, the engine
core: as /metrics reports it, and anonymous) at start (before the first request), after the first 2,000 requests and
at the end; checks that every request got its answer or its error, that nothing is held once idle, that the device
memory allocated at the end is no more than after the first 2,000 requests, and that neither process holds at the
end more than 5% more anonymous resident memory than then.

    PYTHONPATH=. python -m pytest -q -s -m "gpu and slow" tests/gpu/test_serve_soak_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.soak import (DISCONNECT, MALFORMED, RESIDENT, anonymous_resident, ember_serve, kind_of, metrics,
                                send, server_pids, total, wait_idle)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_REQUESTS, FIRST = 20_000, 2_000
MiB = 2 ** 20


def _memory(values: dict, anonymous: dict) -> str:
    return (f"GPU allocated {total(values, 'ember_gpu_memory_allocated_bytes') / MiB:.0f} MiB, reserved "
            f"{total(values, 'ember_gpu_memory_reserved_bytes') / MiB:.0f} MiB; resident: "
            + ", ".join(f"{name} {values[key] / MiB:.0f} MiB (anonymous {anonymous[name] / MiB:.0f} MiB)"
                        for name, key in RESIDENT.items()))


def test_20000_requests_leave_nothing_held_and_memory_flat(tmp_path):
    args = ["--config", "qwen3-0.6b", "--served-model-name", "soak"]
    with ember_serve(args, tmp_path / "serve.log") as (url, proc):
        pids = server_pids(proc, tmp_path / "serve.log")

        def anonymous() -> dict[str, int]:
            return {name: anonymous_resident(pid) for name, pid in pids.items()}

        at_start, anon_start = metrics(url), anonymous()
        start = time.monotonic()
        first = send(url, range(FIRST), text=False, chat=False)
        after_first, anon_first = wait_idle(url), anonymous()
        rest = send(url, range(FIRST, NUM_REQUESTS), text=False, chat=False)
        at_end, anon_end = wait_idle(url), anonymous()
        seconds = time.monotonic() - start
    kinds = [kind_of(i, chat=False) for i in range(NUM_REQUESTS)]
    counts = {k: getattr(first, k) + getattr(rest, k) for k in ("answered", "errors", "disconnected")}
    finished = total(at_end, "ember_request_success_total", finished_reason="length")
    print(f"\n{NUM_REQUESTS} requests in {seconds:.0f} s: {counts}; finished with 'length': {finished:.0f}")
    for label, values, anon in (("at start", at_start, anon_start), (f"after {FIRST}", after_first, anon_first),
                                ("at the end", at_end, anon_end)):
        print(f"{label}: {_memory(values, anon)}")
    assert first.wrong + rest.wrong == []
    assert counts == {"answered": NUM_REQUESTS - kinds.count(DISCONNECT) - kinds.count(MALFORMED),
                      "errors": kinds.count(MALFORMED), "disconnected": kinds.count(DISCONNECT)}
    # what the first requests allocated on first use stays; nothing grows after them
    assert total(at_end, "ember_gpu_memory_allocated_bytes") <= total(after_first, "ember_gpu_memory_allocated_bytes")
    assert all(at_end[key] > 0 for key in RESIDENT.values())
    for name in pids:
        assert anon_end[name] <= 1.05 * anon_first[name], name
