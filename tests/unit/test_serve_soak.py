"""A soak of `ember serve` on the CPU with the default model: 5,000 short requests, streamed and whole, at most 64 at
a time; 10% of the clients leave mid-stream and 5% send malformed JSON. Every request gets its answer or its error,
the server holds nothing once idle (no request in its streams, the engine or the runner's table; no KV block), and
the resident memory of its two processes (the front end, and the engine core where the model runs) at the end is
within 5% of what it was after the first 500 requests. Takes minutes:

    PYTHONPATH=. python -m pytest -q -m slow -s tests/unit/test_serve_soak.py
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.soak import DISCONNECT, MALFORMED, RESIDENT, ember_serve, kind_of, send, total, wait_idle

NUM_REQUESTS, FIRST = 5000, 500


@pytest.mark.slow
def test_5000_requests_leave_nothing_held_and_memory_flat(converted, tmp_path):
    # 384 blocks: the first 500 requests (a block or more each) have written every page of the cache, which on the
    # CPU comes from the OS zeroed and becomes resident when first written; so what moves after them is not the cache
    args = [str(converted["folder"]), "--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "64",
            "--num-kv-blocks", "384", "--served-model-name", "soak"]
    # one intra-op thread: on a small shared CPU, torch's thread pool spins against the server's own threads
    with ember_serve(args, tmp_path / "serve.log", env={"OMP_NUM_THREADS": "1"}) as (url, _):
        start = time.monotonic()
        first = send(url, range(FIRST))
        after_first = wait_idle(url)
        rest = send(url, range(FIRST, NUM_REQUESTS))
        at_end = wait_idle(url)
        seconds = time.monotonic() - start
    resident = {name: (after_first[key], at_end[key]) for name, key in RESIDENT.items()}
    kinds = [kind_of(i, chat=True) for i in range(NUM_REQUESTS)]
    counts = {k: getattr(first, k) + getattr(rest, k) for k in ("answered", "errors", "disconnected")}
    finished = total(at_end, "ember_request_success_total", finished_reason="length")
    print(f"\n{NUM_REQUESTS} requests in {seconds:.0f} s: {counts}; finished with 'length': {finished:.0f}; "
          + "; ".join(f"{name} resident after {FIRST}: {a / 2**20:.1f} MiB, at the end: {b / 2**20:.1f} MiB "
                      f"({100 * (b / a - 1):+.2f}%)" for name, (a, b) in resident.items()))
    assert first.wrong + rest.wrong == []
    assert counts == {"answered": NUM_REQUESTS - kinds.count(DISCONNECT) - kinds.count(MALFORMED),
                      "errors": kinds.count(MALFORMED), "disconnected": kinds.count(DISCONNECT)}
    # a client that left may have had its last token already: it counts as finished, or it was aborted
    assert counts["answered"] <= finished <= counts["answered"] + counts["disconnected"]
    for name, (rss_first, rss_end) in resident.items():
        assert rss_first > 0, f"no {name} resident memory in the metrics"
        assert abs(rss_end - rss_first) <= 0.05 * rss_first, name
