"""ember's small-M linear kernel (`ember::linear`) against cuBLAS (F.linear) on the decode projections of
Qwen3-0.6B and Llama-3.1-8B and a 151936-row lm_head, at 1 and 8 rows, against the measured copy bandwidth.

Run: PYTHONPATH=. python -m pytest benches/bench_gemv.py --benchmark-only -s -q
Calls are timed inside a CUDA graph of many calls, as the engine replays decode steps (a kernel of a few us timed
alone with events would mostly measure its Python launch), cycling through enough weight copies that W comes from
HBM, not L2. A call's time so includes the gap between kernels in a graph, for both sides. Each row also times the
other kernel path (tensor cores for 1 row, CUDA cores for 8) to keep `gemv_config`'s choice honest.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benches.conftest import BenchTable, rotation_count, time_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarks need a CUDA device")

DTYPE = torch.bfloat16
SHAPES = {   # name: (N, K) of W [N, K]
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b gate_up": (6144, 1024), "qwen3-0.6b o_proj": (1024, 2048),
    "qwen3-0.6b down": (1024, 3072), "llama-3.1-8b qkv": (6144, 4096), "llama-3.1-8b o_proj": (4096, 4096),
    "llama-3.1-8b gate_up": (28672, 4096), "llama-3.1-8b down": (4096, 14336), "lm_head": (151936, 1024),
}
ROWS = (1, 8)
MIN_CALLS_PER_GRAPH = 64


def graph_us_per_call(fns, calls: int) -> float:
    """Microseconds per call of `calls` calls, cycling through `fns`, captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # warm-up off the capture stream: compiles kernels, makes cuBLAS handles
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    ms = time_cuda([graph.replay], warmup=3, reps=20)
    del graph
    return 1000 * ms / calls


def _row(table: BenchTable, peaks, name, M, ember_us, cublas_us, other_us, bytes_moved, config):
    floor_us = 1e6 * bytes_moved / peaks.copy_bytes_per_s
    row = dict(suite="gemv", shape=f"{name} {SHAPES[name][0]}x{SHAPES[name][1]}", M=M, ember_us=ember_us,
               cublas_us=cublas_us, floor_us=floor_us, ember_bw_pct=100 * floor_us / ember_us,
               cublas_bw_pct=100 * floor_us / cublas_us, speedup=cublas_us / ember_us,
               path="tc" if config["USE_DOT"] else "cc", other_path_us=other_us,
               tile=f"{config['BLOCK_N']}x{config['BLOCK_K']}/s{config['SPLIT_K']}")
    table.add(**row)
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return row


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_linear(benchmark, device_peaks, bench_table, name, M):
    from ember.kernels import gemv as G
    from ember.kernels import linear_op  # noqa: F401  (registers ember::linear)
    N, K = SHAPES[name]
    weight_bytes = N * K * DTYPE.itemsize
    copies = rotation_count(weight_bytes, device_peaks.l2_bytes)
    weights = [torch.randn(N, K, device="cuda", dtype=DTYPE) for _ in range(copies)]    # [N, K] each
    x = torch.randn(M, K, device="cuda", dtype=DTYPE)                                  # [M, K]
    calls = max(MIN_CALLS_PER_GRAPH, 2 * copies)
    config = G.gemv_config(M, N, K, device_peaks.num_sms)
    other = G.gemv_config(M, N, K, device_peaks.num_sms, use_dot=not config["USE_DOT"])

    ember_us = graph_us_per_call([lambda w=w: torch.ops.ember.linear(x, w, None) for w in weights], calls)
    cublas_us = graph_us_per_call([lambda w=w: F.linear(x, w) for w in weights], calls)
    other_us = graph_us_per_call([lambda w=w: G.gemv(x, w, config=other) for w in weights], calls)
    bytes_moved = weight_bytes + (M * K + M * N) * DTYPE.itemsize
    row = _row(bench_table, device_peaks, name, M, ember_us, cublas_us, other_us, bytes_moved, config)
    benchmark.extra_info.update(row)

    def synced():
        torch.ops.ember.linear(x, weights[0], None)
        torch.cuda.synchronize()
    benchmark.pedantic(synced, rounds=3, iterations=1)
