"""GEMV launch constants and the GEMV/cuBLAS crossover, measured on a whole decode step's projections chained in one
CUDA graph (benches/bench_decode_linears.py), against the measured copy bandwidth.

    PYTHONPATH=. python benches/gemv_sweep.py tiles --configs qwen3-0.6b llama-3.2-1b
    PYTHONPATH=. python benches/gemv_sweep.py crossover --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b --write

`tiles`: every (programs per SM, W tile bytes, warps) at one row, the current constants first.
`crossover`: each projection alone, ember's GEMV (with its fusions) against the same layer as separate kernels on
cuBLAS, for 1..16 rows; the largest row count up to which the GEMV wins is what ember.kernels.gemv_routing stores
(--write). `chain`: the whole step's projections at each row count, routed GEMV against torch's ops.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benches.bench_decode_linears import _graph_ms, _layers
from benches.decode_attention_sweep import copy_bandwidth
from ember.kernels import gemv as G


def _set(**constants) -> None:
    for name, value in constants.items():
        setattr(G, name, value)
    G._cached_config.cache_clear()


def tiles(configs, bw) -> None:
    default = dict(PROGRAMS_PER_SM=G.PROGRAMS_PER_SM, W_TILE_BYTES=G.W_TILE_BYTES, NUM_WARPS=G.NUM_WARPS)
    grid = [default] + [dict(PROGRAMS_PER_SM=p, W_TILE_BYTES=t, NUM_WARPS=w)
                        for p, t, w in itertools.product((2, 4, 8), (8192, 16384), (4, 8))]
    for name in configs:
        layers, q_dim, weight_bytes = _layers(name, torch.device("cuda"))
        x = torch.randn(1, layers[0]["qkv"].shape[1], device="cuda", dtype=torch.bfloat16)
        floor = 1e3 * weight_bytes / bw
        for constants in grid:
            _set(**constants)
            ms = _graph_ms(layers, q_dim, x)
            print(f"tiles {name} M=1 {constants} {ms:.4f} ms  {100 * floor / ms:.1f}% of copy bandwidth", flush=True)
        _set(**default)
        del layers
        torch.cuda.empty_cache()


def chain(configs, bw, rows) -> None:
    """A whole step's chained projections, GEMV (as routed) against torch's unfused ops, per row count."""
    for name in configs:
        layers, q_dim, weight_bytes = _layers(name, torch.device("cuda"))
        floor = 1e3 * weight_bytes / bw
        for m in rows:
            x = torch.randn(m, layers[0]["qkv"].shape[1], device="cuda", dtype=torch.bfloat16)
            G.set_gemv_enabled(True)
            gemv_ms = _graph_ms(layers, q_dim, x)
            G.set_gemv_enabled(False)
            torch_ms = _graph_ms(layers, q_dim, x)
            G.set_gemv_enabled(True)
            print(f"chain {name} M={m} routed {gemv_ms:.4f} ms ({100 * floor / gemv_ms:.1f}%)  torch "
                  f"{torch_ms:.4f} ms ({100 * floor / torch_ms:.1f}%)", flush=True)
        del layers
        torch.cuda.empty_cache()


def _projection_us(op, weight, m: int, l2_bytes: int, use_gemv: bool) -> float:
    """Microseconds per call of one projection at m rows, many calls in one graph over weights rotated out of L2."""
    from benches.bench_gemv import graph_us_per_call
    from benches.conftest import rotation_count
    n_rows, k = weight.shape
    gated, norm, residual = op
    n = n_rows // 2 if gated else n_rows
    copies = rotation_count(weight.numel() * weight.element_size(), l2_bytes)
    weights = [weight] + [torch.randn_like(weight) for _ in range(copies - 1)]
    x = torch.randn(m, k, device="cuda", dtype=weight.dtype)
    nw = torch.ones(k, device="cuda", dtype=weight.dtype) if norm else None
    res = torch.randn(m, n, device="cuda", dtype=weight.dtype) if residual else None
    fl = torch.ops.ember.fused_linear
    G.set_gemv_enabled(use_gemv)
    G.set_gemv_routing(False)          # the GEMV at every row count: this measures where it should stop
    try:
        return graph_us_per_call([lambda w=w: fl(x, w, None, nw, 1e-6, gated, res) for w in weights],
                                 max(64, 2 * copies))
    finally:
        G.set_gemv_enabled(True)
        G.set_gemv_routing(True)


def crossover(configs, bw, rows, write: bool) -> None:
    """Each projection alone: the largest row count up to which the GEMV beats cuBLAS at every row count."""
    from ember.kernels import gemv_routing
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    ops = {"qkv": (False, True, False), "o": (False, False, True), "gate_up": (True, True, False),
           "down": (False, False, True)}      # (gated, RMSNorm prologue, residual epilogue), as the passes fuse them
    found: dict[tuple[int, int, bool], int] = {}
    for name in configs:
        layers, _, _ = _layers(name, torch.device("cuda"))
        for proj, op in ops.items():
            weight = layers[0][proj]
            key = (weight.shape[0], weight.shape[1], op[0])
            if key in found:
                continue
            best, losses = 0, 0
            for m in rows:
                gemv_us = _projection_us(op, weight, m, l2, True)
                torch_us = _projection_us(op, weight, m, l2, False)
                floor = 1e6 * weight.numel() * weight.element_size() / bw
                print(f"crossover {name} {proj} {tuple(weight.shape)} M={m} gemv {gemv_us:.2f} us "
                      f"({100 * floor / gemv_us:.0f}%)  cublas {torch_us:.2f} us ({100 * floor / torch_us:.0f}%)",
                      flush=True)
                if gemv_us < torch_us and losses == 0:
                    best = m
                losses += gemv_us >= torch_us
                if losses >= 2:
                    break
            found[key] = best
            print(f"crossover {name} {proj}: GEMV up to {best} rows")
        del layers
        torch.cuda.empty_cache()
    if write:
        table = dict(command="PYTHONPATH=. python benches/gemv_sweep.py crossover --write",
                     device=torch.cuda.get_device_name(0), torch=torch.__version__,
                     shapes=[dict(n=n, k=k, gated=g, max_rows=r) for (n, k, g), r in sorted(found.items())])
        gemv_routing.TABLE_PATH.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {gemv_routing.TABLE_PATH}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("tiles", "crossover", "chain"))
    p.add_argument("--write", action="store_true", help="crossover: store the table for ember.kernels.gemv_routing")
    p.add_argument("--configs", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"])
    p.add_argument("--rows", type=int, nargs="+", default=list(range(1, G.GEMV_MAX_M + 1)))
    args = p.parse_args()
    import ember.kernels.fused_linear  # noqa: F401  (registers ember::fused_linear)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.what == "tiles":
        tiles(args.configs, bw)
    elif args.what == "chain":
        chain(args.configs, bw, args.rows)
    else:
        crossover(args.configs, bw, args.rows, args.write)


if __name__ == "__main__":
    main()
