"""GEMV launch constants and the GEMV/cuBLAS crossover, measured on a whole decode step's projections chained in one
CUDA graph (benches/bench_decode_linears.py), against the measured copy bandwidth.

    PYTHONPATH=. python benches/gemv_sweep.py tiles --configs qwen3-0.6b llama-3.2-1b
    PYTHONPATH=. python benches/gemv_sweep.py crossover --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b --write
    PYTHONPATH=. python benches/gemv_sweep.py resident --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b
    PYTHONPATH=. python benches/gemv_sweep.py shapes --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b [--write]
    PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b [--fp8] --write

With `--tensor-parallel-sizes 1 2 4`, crossover, shapes and resident also measure each tensor-parallel rank's
shard of every projection (the tables then hold rows for those shapes too; a shape missing from a table takes
the nearest entry's crossover and the launch constants; --write merges into the stored tables, replacing the
shapes measured):

    PYTHONPATH=. python benches/gemv_sweep.py crossover --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b \
        llama-3.1-70b --tensor-parallel-sizes 1 2 4 --write
    PYTHONPATH=. python benches/gemv_sweep.py shapes --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b \
        llama-3.1-70b --tensor-parallel-sizes 1 2 4 --write

`tiles`: every (programs per SM, W tile bytes, warps) at one row, the current constants first.
`resident`: each projection alone at one row, its weights read from HBM (rotated out of L2) and from L2 (the same
weights every call); the difference bounds what prefetching weights into L2 could save, and what is left is the
launch's fixed cost.
`shapes`: each projection alone at one row (weights from HBM) under every (programs per SM, W tile bytes), the
current constants first, then on the TMA kernel (ember.kernels.gemv_tma) under each of TMA_CANDIDATES: which launch
shape, and which kernel, each weight shape would pick on its own. `shapes --rows M [M ...]` (default 1): at each
row count above one, each projection under the constants and benches/gemv_row_shapes.py's candidates (CUDA cores:
programs per SM, W tile bytes, warps; tensor cores: W tile bytes, stages, warps), stored as the document's
`row_shapes` (--write; its one-row shapes are kept) for ember.kernels.gemv_routing.row_shape.
`crossover`: each projection alone, ember's GEMV (with its fusions) against the same layer as separate kernels on
cuBLAS, for 1..16 rows; the largest row count up to which the GEMV wins is what ember.kernels.gemv_routing stores
(--write). `chain`: the whole step's projections at each row count, routed GEMV against torch's ops.
`--fp8` (crossover, shapes): e4m3 weights with row scales (`ember::scaled_linear`, dynamic activations): crossover,
the fp8 GEMV against the many-row path (activations quantized per token, then `torch._scaled_mm`), stored in
gemv_fp8_crossover.json (--write); shapes, the fp8 GEMV's one-row launch shapes (no TMA kernel), stored in
gemv_fp8_shapes.json (--write). The LM head stays bf16 and is left out. Printed percentages count the fp8 bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benches.bench_decode_linears import _graph_ms, _layers
from benches.decode_attention_sweep import copy_bandwidth
from ember.kernels import gemv as G
from ember.kernels import gemv_config as GC
from ember.kernels import linear_op as LO


def _set(**constants) -> None:
    for name, value in constants.items():
        setattr(GC, name, value)
    GC.cached_config.cache_clear()


def tiles(configs, bw) -> None:
    default = dict(PROGRAMS_PER_SM=GC.PROGRAMS_PER_SM, W_TILE_BYTES=GC.W_TILE_BYTES, NUM_WARPS=GC.NUM_WARPS)
    grid = [default] + [dict(PROGRAMS_PER_SM=p, W_TILE_BYTES=t, NUM_WARPS=w)
                        for p, t, w in itertools.product((1, 2, 4, 8), (8192, 16384), (4, 8))]
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
            LO.set_gemv_enabled(True)
            gemv_ms = _graph_ms(layers, q_dim, x)
            LO.set_gemv_enabled(False)
            torch_ms = _graph_ms(layers, q_dim, x)
            LO.set_gemv_enabled(True)
            print(f"chain {name} M={m} routed {gemv_ms:.4f} ms ({100 * floor / gemv_ms:.1f}%)  torch "
                  f"{torch_ms:.4f} ms ({100 * floor / torch_ms:.1f}%)", flush=True)
        del layers
        torch.cuda.empty_cache()


def _projection_us(op, weight, m: int, l2_bytes: int, use_gemv: bool, rotate: bool = True, fp8: bool = False
                   ) -> float:
    """Microseconds per call of one projection at m rows, many calls in one graph over weights rotated out of L2
    (`rotate`), or over the same weights (read from L2 where they fit). op None: the LM head (`ember::logits`,
    float32 out; cuBLAS then a float32 copy without the GEMV). fp8: the weight in e4m3 with row scales, through
    `ember::scaled_linear` (use_gemv False: its many-row path)."""
    from benches.bench_gemv import graph_us_per_call
    from benches.conftest import rotation_count
    from ember.kernels.fp8 import quantize_rows
    from ember.kernels.scaled_linear_op import set_scaled_gemv_routing
    n_rows, k = weight.shape
    gated, norm, residual = op or (False, False, False)
    n = n_rows // 2 if gated else n_rows
    stored = 1 if fp8 else weight.element_size()
    copies = rotation_count(weight.numel() * stored, l2_bytes) if rotate else 1
    weights = [weight] + [torch.randn_like(weight) for _ in range(copies - 1)]
    x = torch.randn(m, k, device="cuda", dtype=weight.dtype)
    nw = torch.ones(k, device="cuda", dtype=weight.dtype) if norm else None
    res = torch.randn(m, n, device="cuda", dtype=weight.dtype) if residual else None
    fl = torch.ops.ember.fused_linear
    LO.set_gemv_enabled(use_gemv)
    LO.set_gemv_routing(False)          # the GEMV at every row count: this measures where it should stop
    set_scaled_gemv_routing(False)
    try:
        if fp8:
            scaled = [quantize_rows(w) for w in weights]
            del weights
            sl = torch.ops.ember.scaled_linear
            return graph_us_per_call([lambda w=w, s=s: sl(x, w, s, None, None, 0, 0, nw, 1e-6, gated, res)
                                      for w, s in scaled], max(64, 2 * copies))
        if op is None:
            return graph_us_per_call([lambda w=w: torch.ops.ember.logits(x, w) for w in weights], max(64, 2 * copies))
        return graph_us_per_call([lambda w=w: fl(x, w, None, nw, 1e-6, gated, res) for w in weights],
                                 max(64, 2 * copies))
    finally:
        LO.set_gemv_enabled(True)
        LO.set_gemv_routing(True)
        set_scaled_gemv_routing(True)


# (gated, RMSNorm prologue, residual epilogue) of each projection, as the passes fuse them; None: the LM head
_OPS = {"qkv": (False, True, False), "o": (False, False, True), "gate_up": (True, True, False),
        "down": (False, False, True), "lm_head": None}


def _projections(configs, tp_sizes=(1,)):
    """(label, projection, (gated, norm, residual), weight) for each distinct weight shape of the configs at each
    tensor-parallel size, one weight alive at a time. A rank's shard (ember.distributed.shard): q/k/v and gate/up
    split their rows (KV heads replicated below one a rank), o and down their columns, the LM head its vocabulary;
    under tensor parallelism o and down fuse no residual add (their all-reduce comes between)."""
    from ember.models.bundled import bundled_config
    seen: set[tuple[int, int, bool]] = set()
    for name in configs:
        cfg = bundled_config(name)
        hidden, inter, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        for tp in tp_sizes:
            if heads % tp or inter % tp or (kv_heads % tp and tp % kv_heads):
                print(f"{name} does not split over {tp} ranks; skipped", flush=True)
                continue
            rows = {"qkv": ((heads // tp + 2 * max(1, kv_heads // tp)) * head_dim, hidden),
                    "o": (hidden, heads * head_dim // tp), "gate_up": (2 * inter // tp, hidden),
                    "down": (hidden, inter // tp), "lm_head": (-(-cfg.vocab_size // tp), hidden)}
            for proj, op in _OPS.items():
                if tp > 1 and proj in ("o", "down"):
                    op = (False, False, False)
                n, k = rows[proj]
                key = (n, k, bool(op and op[0]))
                if key in seen:
                    continue
                seen.add(key)
                weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
                yield (name if tp == 1 else f"{name} tp{tp}"), proj, op, weight
                del weight
                torch.cuda.empty_cache()


def resident(configs, bw, tp_sizes=(1,)) -> None:
    """Each projection at one row: weights from HBM against weights already in L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    for name, proj, op, weight in _projections(configs, tp_sizes):
        nbytes = weight.numel() * weight.element_size()
        hbm_us = _projection_us(op, weight, 1, l2, True)
        l2_us = _projection_us(op, weight, 1, l2, True, rotate=False)
        floor = 1e6 * nbytes / bw
        fits = "fits L2" if nbytes <= l2 // 2 else "larger than half of L2"
        print(f"resident {name} {proj} {tuple(weight.shape)} {nbytes / 1e6:.1f} MB ({fits}): HBM {hbm_us:.2f} us "
              f"({100 * floor / hbm_us:.0f}% of copy bandwidth, floor {floor:.2f} us)  L2 {l2_us:.2f} us", flush=True)


SHAPES_MARGIN = 0.03   # a weight shape's own launch shape is stored when it takes at least this much less time
# ...and its TMA shape (ember.kernels.gemv_tma) when that takes this much less than the best register-streaming one:
# a smaller margin, as two passes over one candidate differed by at most 0.1% on an H100
TMA_MARGIN = 0.02
TMA_CANDIDATES = [(block_n, 256, stages) for block_n in (8, 16, 32) for stages in (3, 4, 6)]


def shapes(configs, bw, rounds: int = 2, write: bool = False, tp_sizes=(1,), fp8: bool = False, rows=(1,)
           ) -> None:
    """Launch shapes at each of `rows`: one row as `_one_row_shapes`, more as `_row_shapes`."""
    if not all(1 <= m <= G.GEMV_MAX_M for m in rows):
        raise SystemExit(f"--rows takes 1 to {G.GEMV_MAX_M}, got {list(rows)}")
    if 1 in rows:
        _one_row_shapes(configs, bw, rounds, write, tp_sizes, fp8)
    if any(m > 1 for m in rows):
        _row_shapes(configs, bw, [m for m in rows if m > 1], rounds, write, tp_sizes, fp8)


def _row_shapes(configs, bw, rows, rounds: int, write: bool, tp_sizes, fp8: bool) -> None:
    """Each projection at each row count (2..16) under the constants and each of benches/gemv_row_shapes.py's
    candidates (CUDA cores and tensor cores), `rounds` interleaved passes. `write`: after each weight shape, store
    the row counts whose best took at least ROWS_MARGIN less time than the constants as the document's
    `row_shapes`, for ember.kernels.gemv_routing.row_shape (the document's one-row shapes are kept)."""
    from benches import gemv_row_shapes as RS
    from ember.kernels import gemv_routing
    props = torch.cuda.get_device_properties(0)
    sms, size = props.multi_processor_count, 1 if fp8 else 2
    path = gemv_routing.FP8_SHAPES_PATH if fp8 else gemv_routing.SHAPES_PATH
    command = ("PYTHONPATH=. python benches/gemv_sweep.py shapes --rows " + " ".join(map(str, rows)) + " --configs "
               + " ".join(configs) + _tp_flag(tp_sizes) + (" --fp8" if fp8 else "") + " --write")
    entries, measured = [], set()
    for name, proj, op, weight in _projections(configs, tp_sizes):
        if fp8 and op is None:          # the LM head stays in the model's dtype
            continue
        n_rows, k = weight.shape
        gated = bool(op and op[0])
        n = n_rows // 2 if gated else n_rows
        floor = 1e6 * weight.numel() * size / bw
        for m in rows:
            grid = RS.candidates(m, n, k, gated, sms, size)
            times = {c: [] for c in grid}
            for _ in range(rounds):
                for shape in grid:
                    with RS.forced_row_shape(shape):
                        times[shape].append(_projection_us(op, weight, m, props.L2_cache_size, True, fp8=fp8))
            mean = {c: sum(t) / len(t) for c, t in times.items()}
            for shape, us in mean.items():
                print(f"rows {name} {proj} {tuple(weight.shape)} M={m} {RS.label(shape)}: "
                      f"{' / '.join(f'{t:.2f}' for t in times[shape])} us ({100 * floor / us:.0f}% of copy "
                      f"bandwidth)", flush=True)
            won = RS.pick(mean)
            best = min(mean, key=mean.get)
            print(f"rows {name} {proj} M={m}: best {RS.label(best)} {mean[best]:.2f} against {mean[None]:.2f} us "
                  f"({100 * (1 - mean[best] / mean[None]):.1f}%){', stored' if won else ''}", flush=True)
            measured.add((n_rows, k, gated, m))
            if won is not None:
                entries.append(RS.row_entry(n_rows, k, gated, m, won, mean[won], mean[None]))
        if write:       # after every weight shape: a run cut short keeps what it measured
            RS.write_row_shapes(path, entries, measured, device=props.name, num_sms=sms, element_size=size,
                                command=command)
    if write:
        print(f"wrote {len(entries)} row launch shapes to {path}", flush=True)


def _one_row_shapes(configs, bw, rounds: int = 2, write: bool = False, tp_sizes=(1,), fp8: bool = False) -> None:
    """Each projection at one row under every (programs per SM, W tile bytes), `rounds` interleaved passes: its
    own best launch shape, against the constants (the first candidate), then each of TMA_CANDIDATES on the TMA
    kernel. `write`: store the shapes whose best took at least SHAPES_MARGIN less time for
    ember.kernels.gemv_routing.launch_shape, and the TMA shapes that took at least TMA_MARGIN less than what the
    register kernel keeps for ember.kernels.gemv_routing.tma_shape, after every weight shape (a run cut short keeps
    what it measured); the stored entries of shapes this run did not measure stay (a table measured on the same
    number of SMs), those it measured are replaced. fp8: e4m3 weights, the register kernel only."""
    from ember.kernels import gemv_routing
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    default = (GC.PROGRAMS_PER_SM, GC.W_TILE_BYTES)
    tiles = (4096, 8192, 16384) if fp8 else (8192, 16384)      # e4m3: 4 KiB tiles give short rows more programs
    grid = [default] + [c for c in itertools.product((2, 4, 8), tiles) if c != default]
    stored, tma_stored, table_lookup, tma_lookup = {}, {}, GC.launch_shape, G.tma_shape
    path = gemv_routing.FP8_SHAPES_PATH if fp8 else gemv_routing.SHAPES_PATH
    previous = json.loads(path.read_text()) if write and path.exists() else {}
    if (previous.get("num_sms"), previous.get("element_size")) == (props.multi_processor_count, 1 if fp8 else 2):
        stored = {(e["n"], e["k"], e["gated"]): e for e in previous.get("shapes", [])}
        tma_stored = {(e["n"], e["k"], e["gated"]): e for e in previous.get("tma_shapes", [])}
    else:
        previous = {}
    GC.launch_shape = lambda *args: None      # every candidate as the constants give it, not the stored table's
    G.tma_shape = lambda *args: None
    try:
        for name, proj, op, weight in _projections(configs, tp_sizes):
            if fp8 and op is None:          # the LM head stays in the model's dtype
                continue
            floor = 1e6 * weight.numel() * (1 if fp8 else weight.element_size()) / bw
            times: dict[tuple[int, int], list[float]] = {c: [] for c in grid}
            for _ in range(rounds):
                for pps, tile in grid:
                    _set(PROGRAMS_PER_SM=pps, W_TILE_BYTES=tile)
                    times[(pps, tile)].append(_projection_us(op, weight, 1, l2, True, fp8=fp8))
            mean = {c: sum(t) / len(t) for c, t in times.items()}
            for (pps, tile), us in mean.items():
                print(f"shapes {name} {proj} {tuple(weight.shape)} programs/SM {pps} tile {tile}: "
                      f"{' / '.join(f'{t:.2f}' for t in times[(pps, tile)])} us "
                      f"({100 * floor / us:.0f}% of copy bandwidth)", flush=True)
            best = min(mean, key=mean.get)
            print(f"shapes {name} {proj}: best programs/SM {best[0]} tile {best[1]}, {mean[best]:.2f} against "
                  f"{mean[default]:.2f} us ({100 * (1 - mean[best] / mean[default]):.1f}%)", flush=True)
            gated = bool(op and op[0])
            key = (weight.shape[0], weight.shape[1], gated)
            won = mean[best] <= (1 - SHAPES_MARGIN) * mean[default]
            kept = mean[best] if won else mean[default]      # what the register kernel takes for this shape
            stored.pop(key, None)
            tma_stored.pop(key, None)
            if won:
                stored[key] = dict(n=key[0], k=key[1], gated=gated, programs_per_sm=best[0], w_tile_bytes=best[1],
                                   us=round(mean[best], 2), constants_us=round(mean[default], 2))
            tma = None if fp8 else _tma_candidates(op, weight, l2, floor, f"{name} {proj} {tuple(weight.shape)}")
            if tma and tma[0] <= (1 - TMA_MARGIN) * kept:
                block_n, block_k, stages = tma[1]
                tma_stored[key] = dict(n=key[0], k=key[1], gated=gated, block_n=block_n, block_k=block_k,
                                       stages=stages, us=round(tma[0], 2), gemv_us=round(kept, 2))
                print(f"shapes {name} {proj}: TMA {tma[1]} {tma[0]:.2f} against {kept:.2f} us", flush=True)
            if write:
                _write_one_row_shapes(path, previous, stored, tma_stored, configs, tp_sizes, fp8, props)
    finally:
        _set(PROGRAMS_PER_SM=default[0], W_TILE_BYTES=default[1])
        GC.launch_shape, G.tma_shape = table_lookup, tma_lookup
    if write:
        print(f"wrote {len(stored)} launch shapes and {len(tma_stored)} TMA shapes to {path}", flush=True)


def _write_one_row_shapes(path, previous: dict, stored: dict, tma_stored: dict, configs, tp_sizes, fp8: bool,
                          props) -> None:
    """The one-row table (the document's row_shapes kept) with the entries in `stored` and `tma_stored`."""
    table = dict(command="PYTHONPATH=. python benches/gemv_sweep.py shapes --configs "
                         + " ".join(configs) + _tp_flag(tp_sizes) + (" --fp8" if fp8 else "") + " --write",
                 device=props.name, num_sms=props.multi_processor_count, element_size=1 if fp8 else 2,
                 shapes=sorted(stored.values(), key=lambda e: (e["n"], e["k"], e["gated"])),
                 tma_shapes=sorted(tma_stored.values(), key=lambda e: (e["n"], e["k"], e["gated"])))
    table.update({key: previous[key] for key in ("row_command", "row_shapes") if key in previous})
    path.write_text(json.dumps(table, indent=1) + "\n")


def _tma_candidates(op, weight, l2: int, floor: float, label: str) -> tuple[float, tuple[int, int, int]] | None:
    """(microseconds, shape) of the fastest TMA shape that applies to one row of this projection, or None."""
    from ember.kernels.gemv_tma import tma_applies
    rows, k = weight.shape
    n = rows // 2 if op and op[0] else rows
    x = torch.empty(1, k, device="cuda", dtype=weight.dtype)
    best = None
    try:
        for shape in TMA_CANDIDATES:
            if not tma_applies(x, weight, n, shape):
                continue
            G.tma_shape = lambda *args, shape=shape: shape
            us = _projection_us(op, weight, 1, l2, True)
            print(f"shapes {label} TMA {shape}: {us:.2f} us ({100 * floor / us:.0f}% of copy bandwidth)", flush=True)
            if best is None or us < best[0]:
                best = (us, shape)
    finally:
        G.tma_shape = lambda *args: None
    return best


def _tp_flag(tp_sizes) -> str:
    return "" if list(tp_sizes) == [1] else " --tensor-parallel-sizes " + " ".join(map(str, tp_sizes))


def crossover(configs, bw, rows, write: bool, tp_sizes=(1,), fp8: bool = False) -> None:
    """Each projection alone: the largest row count up to which the GEMV beats cuBLAS at every row count (fp8:
    the fp8 GEMV against the many-row path)."""
    from ember.kernels import gemv_routing
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    found: dict[tuple[int, int, bool], int] = {}
    for name, proj, op, weight in _projections(configs, tp_sizes):
        if fp8 and op is None:          # the LM head stays in the model's dtype
            continue
        best, losses = 0, 0
        for m in rows:
            gemv_us = _projection_us(op, weight, m, l2, True, fp8=fp8)
            torch_us = _projection_us(op, weight, m, l2, False, fp8=fp8)
            floor = 1e6 * weight.numel() * (1 if fp8 else weight.element_size()) / bw
            print(f"crossover {name} {proj} {tuple(weight.shape)} M={m} gemv {gemv_us:.2f} us "
                  f"({100 * floor / gemv_us:.0f}%)  cublas {torch_us:.2f} us ({100 * floor / torch_us:.0f}%)",
                  flush=True)
            if gemv_us < torch_us and losses == 0:
                best = m
            losses += gemv_us >= torch_us
            if losses >= 2:
                break
        found[(weight.shape[0], weight.shape[1], bool(op and op[0]))] = best
        print(f"crossover {name} {proj}: GEMV up to {best} rows")
    if write:       # merged: the stored shapes this run did not measure stay
        path = gemv_routing.FP8_TABLE_PATH if fp8 else gemv_routing.TABLE_PATH
        previous = json.loads(path.read_text()) if path.exists() else {}
        command = ("PYTHONPATH=. python benches/gemv_sweep.py crossover --configs " + " ".join(configs)
                   + _tp_flag(tp_sizes) + (" --fp8" if fp8 else "") + " --write")
        table = merged_crossover(previous, found, command, torch.cuda.get_device_name(0), torch.__version__)
        path.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {path}")


def merged_crossover(previous: dict, found: dict[tuple[int, int, bool], int], command: str, device: str,
                     torch_version: str) -> dict:
    """The crossover table: `found` {(n, k, gated): max rows} over the `previous` table's entries (its other shapes
    stay). Each entry names the device it was measured on: a shape is looked up by its size alone, so a run on
    another GPU (an H200's tensor-parallel shards beside an H100's whole projections) adds to the table."""
    entries = {(e["n"], e["k"], e["gated"]): dict(e, device=e.get("device", previous.get("device")))
               for e in previous.get("shapes", [])}
    entries.update({key: dict(n=key[0], k=key[1], gated=key[2], max_rows=rows, device=device)
                    for key, rows in found.items()})
    return dict(command=command, device=device, torch=torch_version,
                shapes=[entries[key] for key in sorted(entries)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("tiles", "crossover", "chain", "resident", "shapes"))
    p.add_argument("--write", action="store_true",
                   help="crossover, shapes: store the table for ember.kernels.gemv_routing")
    p.add_argument("--configs", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"])
    p.add_argument("--rows", type=int, nargs="+", default=None, metavar="M",
                   help="crossover, chain: row counts (default 1 to 16); shapes: row counts to find launch shapes "
                        "for (default 1; above one, stored as the document's row_shapes)")
    p.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1], metavar="N",
                   help="crossover, shapes, resident: also each rank's shard of the projections at these sizes")
    p.add_argument("--fp8", action="store_true", help="crossover, shapes: e4m3 weights (ember::scaled_linear)")
    args = p.parse_args()
    rows = args.rows or ([1] if args.what == "shapes" else list(range(1, G.GEMV_MAX_M + 1)))
    import ember.kernels.fused_linear  # noqa: F401  (registers ember::fused_linear)
    import ember.kernels.scaled_linear_op  # noqa: F401  (registers ember::scaled_linear)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.what == "tiles":
        tiles(args.configs, bw)
    elif args.what == "shapes":
        shapes(args.configs, bw, write=args.write, tp_sizes=args.tensor_parallel_sizes, fp8=args.fp8, rows=rows)
    elif args.what == "resident":
        resident(args.configs, bw, args.tensor_parallel_sizes)
    elif args.what == "chain":
        chain(args.configs, bw, rows)
    else:
        crossover(args.configs, bw, rows, args.write, args.tensor_parallel_sizes, args.fp8)


if __name__ == "__main__":
    main()
