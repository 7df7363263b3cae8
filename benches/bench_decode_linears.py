"""The projections of a whole decode step, as the fused model runs them, chained in one CUDA graph: per layer
qkv (RMSNorm prologue), o_proj (+ residual), gate_up (RMSNorm prologue, SiLU·mul) and down (+ residual), each
reading the previous one's output. Timed as one graph replay against the step's weight bytes over the measured copy
bandwidth, with ember's GEMV with PDL, without PDL, and torch's unfused ops (cuBLAS) in the same run.

Run: PYTHONPATH=. python -m pytest benches/bench_decode_linears.py --benchmark-only -s -q
Chained kernels show what a kernel timed alone hides: the launch gap and the ramp of each short kernel (a Qwen3-0.6B
projection reads 4-12 MB, about 1.5-4 us at full bandwidth), and whether weight reads overlap the previous kernel.
"""

from __future__ import annotations

import os

import pytest
import torch

from benches.conftest import time_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarks need a CUDA device")

DTYPE = torch.bfloat16
CONFIGS = ("qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b")
ROWS = (1, 8)
EPS = 1e-6


def _layers(name: str, device: torch.device) -> tuple[list[dict], int, int]:
    from ember.models.bundled import bundled_config
    cfg = bundled_config(name)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q_dim, kv_dim = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim

    def w(n, k):
        return torch.randn(n, k, device=device, dtype=DTYPE) * k ** -0.5
    layers = [dict(qkv=w(q_dim + 2 * kv_dim, hidden), o=w(hidden, q_dim), gate_up=w(2 * inter, hidden),
                   down=w(hidden, inter), norm1=torch.ones(hidden, device=device, dtype=DTYPE),
                   norm2=torch.ones(hidden, device=device, dtype=DTYPE))
              for _ in range(cfg.num_hidden_layers)]
    weight_bytes = sum(t.numel() * t.element_size() for layer in layers for t in layer.values())
    return layers, q_dim, weight_bytes


def _step(layers, q_dim, h):
    fl = torch.ops.ember.fused_linear
    for layer in layers:
        qkv = fl(h, layer["qkv"], None, layer["norm1"], EPS, False, None)
        h = fl(qkv[:, :q_dim], layer["o"], None, None, EPS, False, h)
        g = fl(h, layer["gate_up"], None, layer["norm2"], EPS, True, None)
        h = fl(g, layer["down"], None, None, EPS, False, h)
    return h


def _graph_ms(layers, q_dim, x) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):          # compiles every kernel before capture
        _step(layers, q_dim, x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(layers, q_dim, x)
    ms = time_cuda([graph.replay], warmup=3, reps=30)
    del graph
    return ms


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("name", CONFIGS)
def test_decode_linears(benchmark, device_peaks, bench_table, name, M):
    from ember.kernels.linear_op import set_gemv_enabled
    from ember.kernels import pdl
    import ember.kernels.fused_linear  # noqa: F401  (registers ember::fused_linear)
    layers, q_dim, weight_bytes = _layers(name, torch.device("cuda"))
    x = torch.randn(M, layers[0]["qkv"].shape[1], device="cuda", dtype=DTYPE)
    floor_ms = 1e3 * weight_bytes / device_peaks.copy_bytes_per_s
    times = {}
    saved = os.environ.get("EMBER_PDL")
    try:
        for variant in ("gemv_pdl", "gemv_no_pdl", "torch"):
            os.environ["EMBER_PDL"] = "0" if variant == "gemv_no_pdl" else "1"
            pdl.pdl_options.cache_clear()
            set_gemv_enabled(variant != "torch")
            times[variant] = _graph_ms(layers, q_dim, x)
    finally:
        set_gemv_enabled(True)
        if saved is None:
            os.environ.pop("EMBER_PDL", None)
        else:
            os.environ["EMBER_PDL"] = saved
        pdl.pdl_options.cache_clear()
    row = dict(suite="decode_linears", config=name, M=M, weights_mb=weight_bytes / 1e6, floor_ms=floor_ms,
               **{f"{k}_ms": v for k, v in times.items()},
               **{f"{k}_bw_pct": 100 * floor_ms / v for k, v in times.items()})
    bench_table.add(**row)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (_step(layers, q_dim, x), torch.cuda.synchronize()), rounds=2, iterations=1)
    del layers
    torch.cuda.empty_cache()
