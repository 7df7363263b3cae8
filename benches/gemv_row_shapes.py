"""The GEMV's launch shapes at a few rows (2..16): the candidates `benches/gemv_sweep.py shapes --rows` times for a
weight shape at a row count, the winner it keeps, and the writer of the `row_shapes` of gemv_shapes.json /
gemv_fp8_shapes.json that ember.kernels.gemv_routing.row_shape reads:

    PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --write
    PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --fp8 --write

A candidate is a `RowShape` put in front of `gemv_config` through `forced_row_shape`, the way a stored entry reaches
it, so what is timed is what the table will launch. The constants (None) come first; a candidate whose launch
parameters equal an earlier one's at that shape and row count is timed once.

Run time, estimated from the one-row sweep's structure (each projection alone, weights rotated out of L2, one
graph of 64+ calls replayed 23 times a timing; 6 launch shapes twice + 9 TMA shapes = 21 graphs a weight shape):
here at most 11 candidates (the constants, 6 CUDA-core, 6 tensor-core, less those that launch alike: 8 to 10 for
the 8B's and Qwen3's shapes) twice = 22 graphs a weight shape and row count, 880 over rows 2 4 5 8 and the
10 weight shapes of llama-3.1-8b and qwen3-0.6b. Device time is the weights' bytes, about 1,500 reads of the weight
a graph: ~0.53 s a graph for the 8B's 1.05 GB LM head (47 s over its 88 graphs), ~20 s for its other four weights,
~15 s for Qwen3's. The host adds ~30 ms a graph (capture of 64-128 launches), ~26 s. Compiles: CUDA-core kernels
differ by their padded rows (2, 4, 8: at most 3 x 5 x 10 = 150), tensor-core kernels are shared by every row count
(6 x 10 = 60); the GEMV compiles in ~0.33 s (11 in 3.6 s at start-up, docs/performance.md): ~70 s. So about three
minutes on an H100; the fp8 run (no LM heads) about two.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ember.kernels import gemv_config as GC
from ember.kernels.gemv_routing import RowShape

ROWS_MARGIN = 0.03      # a row count's own launch shape is stored when it takes at least this much less time
# CUDA cores: programs per SM x (W tile bytes, warps): at several rows the products' register budget cuts a 16 KiB
# tile on 4 warps back to what 8 KiB gives, so it is also tried on 8; tensor cores (16 x 16 tiles): W tile bytes
# (the K step) x (stages, warps), at the constant programs per SM (it only sets their K split)
CUDA_CANDIDATES = [RowShape(p, t, False, None, w) for p in (2, 4) for t, w in ((8192, 4), (16384, 4), (16384, 8))]
DOT_CANDIDATES = [RowShape(GC.PROGRAMS_PER_SM, t, True, s, w) for t in (8192, 16384) for s, w in ((3, 4), (4, 4),
                                                                                                   (4, 8))]


@contextlib.contextmanager
def forced_row_shape(shape: RowShape | None):
    """gemv_config as a stored entry `shape` would make it for every weight shape and row count above one (None:
    the constants)."""
    saved = GC.row_shape
    GC.row_shape = lambda *args: shape
    GC.cached_config.cache_clear()
    try:
        yield
    finally:
        GC.row_shape = saved
        GC.cached_config.cache_clear()


def label(shape: RowShape | None) -> str:
    """A candidate in a few characters: `constants`, `cc p2 t8192 w4` (CUDA cores), `tc t16384 s4 w8` (tensor)."""
    if shape is None:
        return "constants"
    if shape.use_dot:
        return f"tc t{shape.w_tile_bytes} s{shape.num_stages} w{shape.num_warps}"
    return f"cc p{shape.programs_per_sm} t{shape.w_tile_bytes} w{shape.num_warps}"


def candidates(m: int, n: int, k: int, gated: bool, num_sms: int, element_size: int) -> list[RowShape | None]:
    """None (the constants), then each candidate whose launch at `m` rows of this weight differs from all before it
    (`n`: output columns, gate or up rows alone when `gated`)."""
    seen, kept = [], []
    for shape in [None] + CUDA_CANDIDATES + DOT_CANDIDATES:
        with forced_row_shape(shape):
            config = GC.gemv_config(m, n, k, num_sms, element_size, gated=gated)
        if config not in seen:
            seen.append(config)
            kept.append(shape)
    return kept


def pick(mean_us: dict[RowShape | None, float], margin: float = ROWS_MARGIN) -> RowShape | None:
    """The fastest candidate where it took at least `margin` less time than the constants (key None), else None."""
    best = min(mean_us, key=mean_us.get)
    return best if best is not None and mean_us[best] <= (1 - margin) * mean_us[None] else None


def row_entry(n_rows: int, k: int, gated: bool, m: int, shape: RowShape, us: float, constants_us: float) -> dict:
    """The `row_shapes` entry of `shape` for `m` rows of a weight of `n_rows` rows (gate and up counted)."""
    entry = dict(n=n_rows, k=k, gated=gated, rows=m, programs_per_sm=shape.programs_per_sm,
                 w_tile_bytes=shape.w_tile_bytes, use_dot=shape.use_dot)
    entry.update({key: getattr(shape, key) for key in ("num_stages", "num_warps") if getattr(shape, key)})
    return dict(entry, us=round(us, 2), constants_us=round(constants_us, 2))


def write_row_shapes(path: Path, entries: list[dict], measured: set[tuple[int, int, bool, int]], *, device: str,
                     num_sms: int, element_size: int, command: str) -> dict:
    """Writes `entries` as the document's `row_shapes`, in place of any earlier entry of a (n, k, gated, rows) in
    `measured` (the ones timed now, won or not), keeping the document's one-row `shapes` and `tma_shapes` and the
    other row entries; a document of another SM count or element size is replaced. Returns the document."""
    previous = json.loads(path.read_text()) if path.exists() else {}
    if previous and (previous.get("num_sms"), previous.get("element_size")) != (num_sms, element_size):
        print(f"{path} holds shapes of {previous.get('num_sms')} SMs, element size {previous.get('element_size')}: "
              f"replaced", flush=True)
        previous = {}
    kept = [e for e in previous.get("row_shapes", [])
            if (int(e["n"]), int(e["k"]), bool(e["gated"]), int(e["rows"])) not in measured]
    doc = dict(command=previous.get("command", ""), device=previous.get("device", device), num_sms=num_sms,
               element_size=element_size, shapes=previous.get("shapes", []),
               tma_shapes=previous.get("tma_shapes", []), row_command=command,
               row_shapes=sorted(kept + list(entries), key=lambda e: (e["n"], e["k"], e["gated"], e["rows"])))
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
