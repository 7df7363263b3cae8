"""A soak of `ember serve` on the CPU with the default model: 5,000 short requests, streamed and whole, at most 64 at
a time; 10% of the clients leave mid-stream and 5% send malformed JSON. Every request gets its answer or its error,
the server holds nothing once idle (no request in its streams, the engine or the runner's table; no KV block), and
neither of its two processes (the front end, and the engine core where the model runs) holds at the end more than
5% more anonymous resident memory than after the first 500 requests (the resident memory /metrics reports is
printed beside it: it also counts mapped libraries, whose pages the kernel drops under memory pressure). Takes
minutes:

    PYTHONPATH=. python -m pytest -q -m slow -s tests/unit/test_serve_soak.py
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.soak import (DISCONNECT, MALFORMED, RESIDENT, anonymous_resident, ember_serve, kind_of, send,
                                server_pids, total, wait_idle)

NUM_REQUESTS, FIRST = 5000, 500


@pytest.mark.slow
def test_5000_requests_leave_nothing_held_and_memory_flat(converted, tmp_path):
    # 384 blocks: the first 500 requests (a block or more each) have written every page of the cache, which on the
    # CPU comes from the OS zeroed and becomes resident when first written; so what moves after them is not the cache
    args = [str(converted["folder"]), "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "64",
            "--num-kv-blocks", "384", "--served-model-name", "soak"]
    # one intra-op thread: on a small shared CPU, torch's thread pool spins against the server's own threads
    with ember_serve(args, tmp_path / "serve.log", env={"OMP_NUM_THREADS": "1"}) as (url, proc):
        pids = server_pids(proc, tmp_path / "serve.log")
        start = time.monotonic()
        first = send(url, range(FIRST))
        after_first = wait_idle(url)
        anon_first = {name: anonymous_resident(pid) for name, pid in pids.items()}
        rest = send(url, range(FIRST, NUM_REQUESTS))
        at_end = wait_idle(url)
        anon_end = {name: anonymous_resident(pid) for name, pid in pids.items()}
        seconds = time.monotonic() - start
    resident = {name: (after_first[key], at_end[key]) for name, key in RESIDENT.items()}
    anonymous = {name: (anon_first[name], anon_end[name]) for name in pids}
    kinds = [kind_of(i, chat=True) for i in range(NUM_REQUESTS)]
    counts = {k: getattr(first, k) + getattr(rest, k) for k in ("answered", "errors", "disconnected")}
    finished = total(at_end, "ember_request_success_total", finished_reason="length")
    print(f"\n{NUM_REQUESTS} requests in {seconds:.0f} s: {counts}; finished with 'length': {finished:.0f}")
    for label, figures in (("resident (/metrics)", resident), ("anonymous resident", anonymous)):
        print(f"{label} after {FIRST} -> at the end: " + "; ".join(
            f"{name} {a / 2**20:.1f} -> {b / 2**20:.1f} MiB ({100 * (b / a - 1):+.2f}%)"
            for name, (a, b) in figures.items()))
    assert first.wrong + rest.wrong == []
    assert counts == {"answered": NUM_REQUESTS - kinds.count(DISCONNECT) - kinds.count(MALFORMED),
                      "errors": kinds.count(MALFORMED), "disconnected": kinds.count(DISCONNECT)}
    # a client that left may have had its last token already: it counts as finished, or it was aborted
    assert counts["answered"] <= finished <= counts["answered"] + counts["disconnected"]
    assert all(a > 0 for a, _ in resident.values()), resident
    for name, (anon_first_bytes, anon_end_bytes) in anonymous.items():
        assert anon_end_bytes <= 1.05 * anon_first_bytes, name
