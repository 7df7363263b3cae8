"""The MoE kernels' launch table (ember/kernels/moe_configs.json): per bundled MoE config, the decode GEMV's and the
grouped GEMM's launch shapes measured at a range of token counts, and the token count up to which the decode path
beats the grouped GEMM.

    PYTHONPATH=. python benches/moe_sweep.py --configs qwen3-30b-a3b mixtral-8x7b [--tensor-parallel-size 1 2] [--write]

Under tensor parallelism a rank's layer holds intermediate / N of every expert, and the table is looked up by that
shape: `--tensor-parallel-size 2` sweeps the rank's shape (1, the default, the whole layer's).

Each candidate is timed inside a CUDA graph of many calls, each on another token batch (its routing from random
logits), so the experts a call reads come from HBM. gate_up and down are chosen apart for each BLOCK_M (they share
only the alignment's block), and the pair with the least total time is stored. --write merges the shapes into the
table for this GPU's SM count (an entry for another SM count or element size is replaced: one device per file).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benches.bench_gemv import graph_us_per_call
from ember.kernels.moe_align import moe_align
from ember.kernels.moe_configs import TABLE_PATH, MoeShape, fallback_launch
from ember.kernels.moe_gemm import moe_down, moe_gate_up
from ember.kernels.moe_gemv import moe_gemv
from ember.kernels.moe_router import route
from ember.models.bundled import bundled_config
from ember.models.layers.moe import num_experts_of

DTYPE = torch.bfloat16
GEMV_TOKENS = (1, 2, 4, 8, 16)
# every GEMV token count too (the crossover compares them); others take the nearest, more than 4096 take 4096's
GROUPED_TOKENS = (1, 2, 4, 8, 16, 64, 128, 256, 512, 1024, 2048, 4096)
BATCHES = 8
GEMV_CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4) for n, k in itertools.product((1, 2, 4, 8, 16, 32),
                                                                                           (128, 256, 512))]
GEMV_MAX_TILE = 16384     # float32 accumulator elements a GEMV program may hold (64 a thread at 4 warps)
GROUPED_CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=w, num_stages=s)
                      for n, k, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4))]


def _layer_shape(name: str, tp: int = 1) -> tuple[int, int, int, int]:
    """(experts, hidden, intermediate, top_k) of a rank's MoE layer at `tp` ranks."""
    cfg = bundled_config(name)
    intermediate = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    if intermediate % tp:
        raise SystemExit(f"{name}: the experts' intermediate size {intermediate} is not divisible by "
                         f"--tensor-parallel-size {tp}")
    return num_experts_of(cfg), cfg.hidden_size, intermediate // tp, cfg.num_experts_per_tok


def _time(fns, calls: int) -> float | None:
    """us per call, or None where the candidate does not compile or run (shared memory, registers)."""
    try:
        return graph_us_per_call(fns, calls)
    except Exception as e:       # noqa: BLE001  (a candidate that cannot run is skipped, and said so)
        print(f"  skipped: {type(e).__name__}: {str(e)[:120]}", flush=True)
        torch.cuda.synchronize()
        return None


def _batches(num_tokens, hidden, num_experts, top_k):
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    out = []
    for _ in range(BATCHES):
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=DTYPE, generator=g)
        logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=DTYPE, generator=g)
        out.append((x, *route(logits, top_k, True)))
    return out


def sweep_gemv(w13, w2, batches) -> tuple[dict, dict, float]:
    """Best gate_up and down GEMV shapes (each timed with the other at the constants), and their total us."""
    default = fallback_launch(MoeShape(batches[0][0].shape[0], w13.shape[0], w13.shape[2], w13.shape[1] // 2,
                                       batches[0][2].shape[1], 2, torch.cuda.get_device_properties(0)
                                       .multi_processor_count), gemv_max_tokens=1 << 30)
    best = {}
    k_p2 = 1 << (batches[0][2].shape[1] - 1).bit_length()
    for part in ("gate_up", "down"):
        timed = []
        for cand in GEMV_CANDIDATES:
            if (2 if part == "gate_up" else k_p2) * cand["BLOCK_N"] * cand["BLOCK_K"] > GEMV_MAX_TILE:
                continue
            gate_up, down = (cand, default.down) if part == "gate_up" else (default.gate_up, cand)
            us = _time([lambda b=b: moe_gemv(*b, w13, w2, gate_up, down) for b in batches], 4 * BATCHES)
            if us is not None:
                timed.append((us, cand))
        best[part] = min(timed, key=lambda t: t[0])[1]
    total = _time([lambda b=b: moe_gemv(*b, w13, w2, best["gate_up"], best["down"]) for b in batches], 4 * BATCHES)
    return best["gate_up"], best["down"], total


def sweep_grouped(w13, w2, batches) -> tuple[dict, dict, float]:
    """Per BLOCK_M, the best gate_up and down shapes; the BLOCK_M whose pair is fastest; its total us."""
    num_tokens, top_k = batches[0][2].shape
    rows = num_tokens * top_k / w13.shape[0]
    block_ms = sorted({16, 32, 64, 128} & {m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows)})
    choice = None
    for block_m in block_ms:
        aligned = [(x, w, ids, moe_align(ids, w13.shape[0], block_m)) for x, w, ids in batches]
        acts = [moe_gate_up(x, w13, a[0], a[1], top_k, dict(GROUPED_CANDIDATES[0], BLOCK_M=block_m))
                for x, _, _, a in aligned]
        pair, total = {}, 0.0
        for part in ("gate_up", "down"):
            timed = []
            for cand in GROUPED_CANDIDATES:
                config = dict(cand, BLOCK_M=block_m)
                if part == "gate_up":
                    fns = [lambda x=x, a=a: moe_gate_up(x, w13, a[0], a[1], top_k, config) for x, _, _, a in aligned]
                else:
                    fns = [lambda act=act, w=w, a=a: moe_down(act, w2, a[0], a[1], w, config)
                           for act, (_, w, _, a) in zip(acts, aligned)]
                us = _time(fns, BATCHES if num_tokens >= 1024 else 4 * BATCHES)
                if us is not None:
                    timed.append((us, config))
            us, pair[part] = min(timed, key=lambda t: t[0])
            total += us
        print(f"  BLOCK_M {block_m}: gate_up {pair['gate_up']} + down {pair['down']} = {total:.1f} us", flush=True)
        if choice is None or total < choice[2]:
            choice = (pair["gate_up"], pair["down"], total)
    return choice


def sweep(name: str, tp: int = 1) -> dict:
    num_experts, hidden, intermediate, top_k = _layer_shape(name, tp)
    name = name if tp == 1 else f"{name} (a rank of {tp})"
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device="cuda", dtype=DTYPE, generator=g) * 0.02
    w2 = torch.randn(num_experts, hidden, intermediate, device="cuda", dtype=DTYPE, generator=g) * 0.02
    entry = dict(experts=num_experts, hidden=hidden, intermediate=intermediate, top_k=top_k, grouped=[])
    gemv_us = {}
    for num_tokens in GEMV_TOKENS:
        gate_up, down, us = sweep_gemv(w13, w2, _batches(num_tokens, hidden, num_experts, top_k))
        gemv_us[num_tokens] = (us, gate_up, down)
        print(f"{name} gemv T={num_tokens}: {us:.1f} us {gate_up} {down}", flush=True)
    for num_tokens in GROUPED_TOKENS:
        gate_up, down, us = sweep_grouped(w13, w2, _batches(num_tokens, hidden, num_experts, top_k))
        entry["grouped"].append(dict(tokens=num_tokens, gate_up=gate_up, down=down, us=round(us, 2)))
        print(f"{name} grouped T={num_tokens}: {us:.1f} us", flush=True)
    grouped_us = {e["tokens"]: e["us"] for e in entry["grouped"]}
    assert set(GEMV_TOKENS) <= set(grouped_us), "the crossover needs the grouped GEMM at every GEMV token count"
    # the decode path up to the last token count where it beats the grouped GEMM without a loss before it
    wins = [t for t in GEMV_TOKENS if gemv_us[t][0] < grouped_us[t]]
    entry["gemv_max_tokens"] = max((t for t in wins if all(u in wins for u in GEMV_TOKENS if u <= t)), default=0)
    if entry["gemv_max_tokens"]:
        _, gate_up, down = gemv_us[entry["gemv_max_tokens"]]
        entry["gemv"] = dict(gate_up=gate_up, down=down)
    entry["gemv_us"] = {str(t): round(v[0], 2) for t, v in gemv_us.items()}
    del w13, w2
    torch.cuda.empty_cache()
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                        help="sweep a rank's shape at each of these tensor-parallel sizes (default: 1, the whole layer)")
    parser.add_argument("--write", action="store_true", help=f"merge the results into {TABLE_PATH}")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    entries = [sweep(name, tp) for name in args.configs for tp in args.tensor_parallel_size]
    print(json.dumps(entries, indent=1))
    if not args.write:
        return
    doc = {"shapes": []}
    if TABLE_PATH.is_file():
        doc = json.loads(TABLE_PATH.read_text())
        if doc.get("num_sms") != props.multi_processor_count or doc.get("element_size") != 2:
            doc = {"shapes": []}
    keys = {(e["experts"], e["hidden"], e["intermediate"], e["top_k"]) for e in entries}
    kept = [e for e in doc["shapes"] if (e["experts"], e["hidden"], e["intermediate"], e["top_k"]) not in keys]
    sizes = "" if args.tensor_parallel_size == [1] else \
        " --tensor-parallel-size " + " ".join(map(str, args.tensor_parallel_size))
    doc = {"command": "PYTHONPATH=. python benches/moe_sweep.py --configs " + " ".join(args.configs) + sizes +
                      " --write",
           "device": props.name, "num_sms": props.multi_processor_count, "element_size": 2,
           "shapes": kept + entries}
    TABLE_PATH.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {TABLE_PATH}")


if __name__ == "__main__":
    main()
