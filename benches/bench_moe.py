"""The MoE layer alone (`ember::moe`: routing, experts, top_k sum) on the layer shapes of Qwen3-30B-A3B and
Mixtral-8x7B in bfloat16, at 1, 8, 64 and 512 tokens, against the bytes and FLOPs it must move and against the same
layer as a loop over experts with torch ops, in the same run.

Run: PYTHONPATH=. python -m pytest benches/bench_moe.py --benchmark-only -s -q
The op is timed inside a CUDA graph of many calls (as the engine replays it), each call on another token batch, so
the experts a call reads are not the ones the call before it left in L2. Its floor: the bytes of the experts the
routing chose (counted per batch), the router's weight and the activations, over the measured copy bandwidth, or
the FLOPs (2 x tokens x top_k x 3 x H x I, plus the router) over the measured bf16 matmul rate, whichever is longer.
The loop over experts (ember.kernels.moe_gemm.moe_reference, with the router in torch) reads each chosen expert's
weights with cuBLAS; it syncs with the host to find them, so it is timed with events, call by call. Each row also
times the path the launch table did not choose.
"""

from __future__ import annotations

import pytest
import torch

from benches.bench_gemv import graph_us_per_call
from benches.conftest import time_cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="benchmarks need a CUDA device")

DTYPE = torch.bfloat16
LAYERS = {"qwen3-30b-a3b": (128, 2048, 768, 8, True), "mixtral-8x7b": (8, 4096, 14336, 2, True)}
TOKENS = (1, 8, 64, 512)
BATCHES = 16          # token batches a graph cycles through


@pytest.fixture(scope="module", params=list(LAYERS))
def layer(request):
    num_experts, hidden, intermediate, top_k, renormalize = LAYERS[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device="cuda", dtype=DTYPE, generator=g) * 0.02
    w2 = torch.randn(num_experts, hidden, intermediate, device="cuda", dtype=DTYPE, generator=g) * 0.02
    router = torch.randn(num_experts, hidden, device="cuda", dtype=DTYPE, generator=g) * 0.02
    yield request.param, w13, w2, router, top_k, renormalize
    del w13, w2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("num_tokens", TOKENS)
def test_moe_layer(benchmark, device_peaks, bench_table, layer, num_tokens):
    from ember.kernels import moe_op
    from ember.kernels.moe_configs import MoeShape, fallback_launch
    from ember.kernels.moe_gemm import moe_reference
    from ember.kernels.moe_router import route, route_reference

    name, w13, w2, router, top_k, renormalize = layer
    num_experts, hidden, intermediate = w13.shape[0], w13.shape[2], w13.shape[1] // 2
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    xs = [torch.randn(num_tokens, hidden, device="cuda", dtype=DTYPE, generator=g) for _ in range(BATCHES)]
    logits = [x @ router.t() for x in xs]                                                      # [T, E] each
    calls = 4 * BATCHES

    def op(i):
        return lambda: moe_op.moe(xs[i], xs[i] @ router.t(), w13, w2, top_k, renormalize)

    ember_us = graph_us_per_call([op(i) for i in range(BATCHES)], calls)
    launch = moe_op.launch_for(xs[0], w13, top_k)
    shape = MoeShape(num_tokens, num_experts, hidden, intermediate, top_k, 2, device_peaks.num_sms)
    other = fallback_launch(shape, gemv_max_tokens=0 if launch.path == "gemv" else num_tokens)
    routed = [route(lg, top_k, renormalize) for lg in logits]

    def other_path(i):     # the router and the routing kernel included, as in the op
        return lambda: moe_op.fused_experts(xs[i], *route(xs[i] @ router.t(), top_k, renormalize), w13, w2, other)

    other_us = graph_us_per_call([other_path(i) for i in range(BATCHES)], calls)

    def loop(i):
        def run():
            weights, ids = route_reference(xs[i] @ router.t(), top_k, renormalize)
            return moe_reference(xs[i], weights, ids, w13, w2)
        return run

    torch_us = 1000 * time_cuda([loop(i) for i in range(BATCHES)], warmup=3, reps=2 * BATCHES)

    element = DTYPE.itemsize
    expert_bytes = 3 * hidden * intermediate * element
    distinct = sum(len(torch.unique(ids)) for _, ids in routed) / BATCHES
    bytes_moved = (distinct * expert_bytes + router.numel() * element + 2 * num_tokens * hidden * element)
    flops = 2 * num_tokens * (top_k * 3 * hidden * intermediate + num_experts * hidden)
    floor_us = 1e6 * max(bytes_moved / device_peaks.copy_bytes_per_s, flops / device_peaks.bf16_flops_per_s)
    row = dict(suite="moe", layer=name, tokens=num_tokens, path=launch.path, ember_us=ember_us,
               other_path_us=other_us, torch_loop_us=torch_us, floor_us=floor_us,
               pct_of_floor=100 * floor_us / ember_us, gb_s=bytes_moved / ember_us / 1e3,
               tflop_s=flops / ember_us / 1e6, experts_read=distinct, vs_torch=torch_us / ember_us)
    bench_table.add(**row)
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    benchmark.extra_info.update(row)
    benchmark.pedantic(op(0), rounds=1, iterations=1)
    assert 0 < row["pct_of_floor"] < 110     # above 100% the byte or FLOP count, or the peaks, are wrong
