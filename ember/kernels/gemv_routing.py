"""Where ember's GEMV beats cuBLAS: the largest row count, per weight shape, at which the GEMV (with its fusions)
was measured faster than the same layer as separate kernels on cuBLAS. The table is data
(gemv_crossover.json beside this file), written on an H100 by

    PYTHONPATH=. python benches/gemv_sweep.py crossover --write

Each projection of the bundled configs is timed alone, many calls captured in one CUDA graph with its weights
rotated out of L2. A shape that is not in the table takes the entry nearest in weight size (same gating first);
without a table, the GEMV takes one row only, where it won for every measured shape."""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from pathlib import Path
from typing import NamedTuple

__all__ = ["FP8_SHAPES_PATH", "FP8_TABLE_PATH", "SHAPES_PATH", "TABLE_PATH", "RowShape", "gemv_fp8_max_rows",
           "gemv_max_rows", "launch_shape", "load_row_shapes", "load_shapes", "load_table", "row_bucket", "row_shape",
           "tma_shape"]

TABLE_PATH = Path(__file__).with_name("gemv_crossover.json")
FP8_TABLE_PATH = Path(__file__).with_name("gemv_fp8_crossover.json")
SHAPES_PATH = Path(__file__).with_name("gemv_shapes.json")
FP8_SHAPES_PATH = Path(__file__).with_name("gemv_fp8_shapes.json")      # e4m3 weights (element size 1)
FALLBACK_MAX_ROWS = 1


def _read(path: Path, parse, what: str, otherwise: str) -> dict:
    """parse(the JSON document at `path`); {} when the file is missing, and {} with a warning naming `what` and
    what happens `otherwise` when it cannot be read or parsed."""
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring the GEMV {what} table {path}: {e!r}; {otherwise}")
        return {}


def load_table(path: Path = TABLE_PATH) -> dict[tuple[int, int, bool], int]:
    """{(weight rows, K, gated): max rows} from `path`; {} (with a warning) when it is missing or unreadable."""
    return _read(path, lambda doc: {(int(e["n"]), int(e["k"]), bool(e["gated"])): int(e["max_rows"])
                                    for e in doc["shapes"]},
                 "crossover", f"the GEMV takes {FALLBACK_MAX_ROWS} row")


@functools.cache
def _table() -> dict[tuple[int, int, bool], int]:
    return load_table()


@functools.lru_cache(maxsize=None)
def gemv_max_rows(n: int, k: int, gated: bool, table: tuple | None = None) -> int:
    """The most rows the GEMV should take for a weight of `n` rows and `k` columns (gate and up rows counted when
    `gated`). `table`: entries as a tuple of ((n, k, gated), max_rows) pairs instead of the stored table."""
    entries = dict(table) if table is not None else _table()
    if not entries:
        return FALLBACK_MAX_ROWS
    if (n, k, gated) in entries:
        return entries[(n, k, gated)]
    size = math.log(n * k)
    same = [key for key in entries if key[2] == gated] or list(entries)
    nearest = min(same, key=lambda key: (abs(math.log(key[0] * key[1]) - size), key))
    return entries[nearest]


@functools.cache
def _fp8_table() -> dict[tuple[int, int, bool], int]:
    return load_table(FP8_TABLE_PATH)


@functools.lru_cache(maxsize=None)
def gemv_fp8_max_rows(n: int, k: int, gated: bool) -> int:
    """The most rows the fp8 GEMV should take (against `torch._scaled_mm` or the block-scaled GEMM) for an e4m3
    weight of `n` rows and `k` columns, from gemv_fp8_crossover.json, written on an H200 (132 SMs, an H100's count) by

        PYTHONPATH=. python benches/gemv_sweep.py crossover --fp8 --write

    Without that table, the bf16 table's answer for the shape: both sides of the crossover read half the bytes at
    fp8, and the many-row side also quantizes the activations, so the bf16 crossover is a floor."""
    table = _fp8_table()
    return gemv_max_rows(n, k, gated, tuple(table.items())) if table else gemv_max_rows(n, k, gated)


# ---- launch shapes ----------------------------------------------------------------------------------------------
# One-row launch shapes that beat the GEMV's constants for a weight shape, written on an H100 by
#
#     PYTHONPATH=. python benches/gemv_sweep.py shapes --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b --write
#
# and for e4m3 weights (the fp8 GEMV after its activation rounding; gemv_fp8_shapes.json, element size 1) by
#
#     PYTHONPATH=. python benches/gemv_sweep.py shapes --fp8 --configs qwen3-0.6b llama-3.2-1b llama-3.1-8b --write
#
# (each projection alone, weights rotated out of L2, under every (programs per SM, W tile bytes); a shape is stored
# where its best pair took at least `shapes`' margin less time than the constants). An entry holds for GPUs of the
# SM count it was measured on; EMBER_GEMV_SHAPES=0 leaves every shape on the constants.

def load_shapes(path: Path = SHAPES_PATH) -> dict[tuple[int, int, bool, int, int], tuple[int, int]]:
    """{(weight rows, K, gated, SMs, element size): (programs per SM, W tile bytes)} from `path`; {} (with a warning
    when unreadable) when it is missing or unreadable."""
    def parse(doc):
        sms, size = int(doc["num_sms"]), int(doc["element_size"])
        return {(int(e["n"]), int(e["k"]), bool(e["gated"]), sms, size):
                (int(e["programs_per_sm"]), int(e["w_tile_bytes"])) for e in doc["shapes"]}

    return _read(path, parse, "launch-shape", "every shape takes the constants")


def load_tma_shapes(path: Path = SHAPES_PATH) -> dict[tuple[int, int, bool, int, int], tuple[int, int, int]]:
    """{(weight rows, K, gated, SMs, element size): (BLOCK_N, BLOCK_K, stages)} of the shapes whose one row is
    measured faster on the TMA kernel (ember.kernels.gemv_tma), from the same document's `tma_shapes`."""
    def parse(doc):
        sms, size = int(doc["num_sms"]), int(doc["element_size"])
        return {(int(e["n"]), int(e["k"]), bool(e["gated"]), sms, size):
                (int(e["block_n"]), int(e["block_k"]), int(e["stages"])) for e in doc.get("tma_shapes", [])}

    return _read(path, parse, "launch-shape", "no shape takes the TMA kernel")


@functools.cache
def _shapes() -> dict:
    # the bf16 and the fp8 documents: their keys differ by element size
    return {} if os.environ.get("EMBER_GEMV_SHAPES", "1") == "0" else {**load_shapes(SHAPES_PATH),
                                                                       **load_shapes(FP8_SHAPES_PATH)}


@functools.cache
def _tma_shapes() -> dict:
    return {} if os.environ.get("EMBER_GEMV_SHAPES", "1") == "0" else load_tma_shapes()


def launch_shape(n: int, k: int, gated: bool, num_sms: int, element_size: int) -> tuple[int, int] | None:
    """The stored one-row (programs per SM, W tile bytes) for a weight of `n` rows (gate and up rows counted when
    `gated`) and `k` columns on a GPU of `num_sms` SMs, or None."""
    return _shapes().get((n, k, gated, num_sms, element_size))


def tma_shape(n: int, k: int, gated: bool, num_sms: int, element_size: int) -> tuple[int, int, int] | None:
    """The stored (BLOCK_N, BLOCK_K, stages) of the TMA kernel for one row of a weight of `n` rows (gate and up rows
    counted when `gated`) and `k` columns on a GPU of `num_sms` SMs, or None (the register-streaming kernel)."""
    return _tma_shapes().get((n, k, gated, num_sms, element_size))


# ---- launch shapes of a few rows ----------------------------------------------------------------------------------
# Launch shapes for 2..16 rows (a verify step's k + 1 tokens, a small batch) that beat the constants for a weight
# shape at a row count, in the same documents' `row_shapes` (a document without them loads as before), written by
#
#     PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --write
#     PYTHONPATH=. python benches/gemv_sweep.py shapes --rows 2 4 5 8 --configs llama-3.1-8b qwen3-0.6b --fp8 --write
#
# An entry measured at `rows` serves the row counts of its bucket (`row_bucket`: the rows the CUDA-core kernel pads
# to, the next power of two, so 5 to 8 rows run one compiled kernel whatever the entry), the nearest measured row
# count within it (the lower on a tie); a row count whose bucket holds no entry takes the constants. The crossover
# above decides whether the engine gives those rows to the GEMV at all: measure it again (`crossover --write`) after
# new row shapes.

class RowShape(NamedTuple):
    """A stored launch shape of a few rows: `gemv_config`'s (programs per SM, W tile bytes), tensor cores or CUDA
    cores, the tensor-core kernel's pipeline stages and either kernel's warps (None: the constants). More warps
    raise the register budget that caps a CUDA-core tile at several rows."""
    programs_per_sm: int
    w_tile_bytes: int
    use_dot: bool
    num_stages: int | None = None
    num_warps: int | None = None


def row_bucket(m: int) -> int:
    """The power of two at or above `m`: row counts of one bucket share a stored entry."""
    return 1 << max(0, m - 1).bit_length()


def load_row_shapes(path: Path = SHAPES_PATH) -> dict[tuple[int, int, bool, int, int, int], RowShape]:
    """{(weight rows, K, gated, SMs, element size, rows): RowShape} from the document's `row_shapes`; {} when it has
    none, is missing, or (with a warning) unreadable."""
    def parse(doc):
        sms, size = int(doc["num_sms"]), int(doc["element_size"])
        table = {}
        for e in doc.get("row_shapes", []):
            rows = int(e["rows"])
            if rows < 2:
                raise ValueError(f"a row_shapes entry needs rows >= 2 (one row is `shapes`), got {rows}")
            stages, warps = e.get("num_stages"), e.get("num_warps")
            table[(int(e["n"]), int(e["k"]), bool(e["gated"]), sms, size, rows)] = RowShape(
                int(e["programs_per_sm"]), int(e["w_tile_bytes"]), bool(e["use_dot"]),
                None if stages is None else int(stages), None if warps is None else int(warps))
        return table

    return _read(path, parse, "launch-shape", "every row count above one takes the constants")


@functools.cache
def _row_shapes() -> dict[tuple[int, int, bool, int, int], dict[int, RowShape]]:
    """{(weight rows, K, gated, SMs, element size): {rows: RowShape}} of both documents."""
    if os.environ.get("EMBER_GEMV_SHAPES", "1") == "0":
        return {}
    found: dict = {}
    for path in (SHAPES_PATH, FP8_SHAPES_PATH):
        for (*key, rows), shape in load_row_shapes(path).items():
            found.setdefault(tuple(key), {})[rows] = shape
    return found


def row_shape(n: int, k: int, gated: bool, num_sms: int, element_size: int, m: int) -> RowShape | None:
    """The stored launch shape for `m` >= 2 rows of a weight of `n` rows (gate and up rows counted when `gated`)
    and `k` columns on a GPU of `num_sms` SMs: the entry of the nearest measured row count in m's bucket, or None."""
    by_rows = _row_shapes().get((n, k, gated, num_sms, element_size))
    if not by_rows or m < 2:
        return None
    bucket = [rows for rows in by_rows if row_bucket(rows) == row_bucket(m)]
    return by_rows[min(bucket, key=lambda rows: (abs(rows - m), rows))] if bucket else None
