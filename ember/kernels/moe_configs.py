"""Launch shapes of the MoE kernels: a stored table per MoE shape (moe_configs.json beside this file, written on a GPU
by `PYTHONPATH=. python benches/moe_sweep.py --write`), with constants where the table has no entry. Nothing is
timed at start-up, so every process picks the same kernels and the first call for a token count only compiles.

A table entry is keyed by (experts, hidden, intermediate, top_k) and holds for GPUs of the SM count and element size
it was measured with. It gives the most tokens the decode path (ember.kernels.moe_gemv) takes, that path's two
kernel shapes, and the grouped GEMM's shapes at a few token counts; a token count takes the stored count nearest to
it on a log scale.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["TABLE_PATH", "MoeShape", "MoeLaunch", "fallback_launch", "load_table", "moe_launch"]

TABLE_PATH = Path(__file__).with_name("moe_configs.json")
W_TILE_BYTES = 8192       # bytes of weights a GEMV program loads per K step (as ember's dense GEMV)
MIN_PROGRAMS_PER_SM = 2   # the down GEMV narrows its column block until the grid has this many programs per SM


@dataclass(frozen=True)
class MoeShape:
    """What picks the kernels' launch shapes: the layer's shape, the token count, and the device."""
    num_tokens: int
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    element_size: int
    num_sms: int


@dataclass(frozen=True)
class MoeLaunch:
    """The path ("gemv" or "grouped") and each of its two kernels' launch parameters."""
    path: str
    gate_up: dict = field(hash=False)
    down: dict = field(hash=False)


def _gemv_kernel_shape(block_rows: int, k: int, element_size: int, min_programs: int, columns: int,
                       rows_per_program: int) -> dict:
    """BLOCK_K as a warp's 16-byte loads (at most K), BLOCK_N to fill W_TILE_BYTES over `block_rows` weight
    matrices, narrowed while fewer than `min_programs` programs would cover `columns`."""
    block_k = min(512 // element_size, 1 << max(4, (k - 1).bit_length()))
    block_n = max(1, W_TILE_BYTES // (element_size * block_k * block_rows))
    block_n = 1 << (block_n.bit_length() - 1)
    while block_n > 1 and rows_per_program * -(-columns // block_n) < min_programs:
        block_n //= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def _grouped_kernel_shape(rows_per_expert: float, element_size: int, gated: bool) -> dict:
    """Tiles by the average rows an expert gets: short row blocks where experts get few tokens, so that padding
    stays small; gate_up keeps two accumulators, so its column block is half the down kernel's at the largest."""
    block_k = 64 if element_size <= 2 else 32     # float32 tiles take twice the shared memory
    if rows_per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=2 * block_k, GROUP_M=1, num_warps=4, num_stages=3)
    if rows_per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=4, num_warps=4, num_stages=4)
    if rows_per_expert <= 256:
        return dict(BLOCK_M=64, BLOCK_N=64 if gated else 128, BLOCK_K=block_k, GROUP_M=8, num_warps=4,
                    num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=64 if gated else 128, BLOCK_K=block_k, GROUP_M=8, num_warps=8, num_stages=3)


def fallback_gemv_max_tokens(num_experts: int, top_k: int) -> int:
    """Without a table: the decode path while the token-slots cover at most a quarter of the experts (so few
    experts are read twice), and always at one token."""
    return max(1, num_experts // (4 * top_k))


def fallback_launch(shape: MoeShape, gemv_max_tokens: int | None = None) -> MoeLaunch:
    """The constants' choice for `shape`; the decode path up to `gemv_max_tokens` (default: the constants')."""
    s = shape
    if gemv_max_tokens is None:
        gemv_max_tokens = fallback_gemv_max_tokens(s.num_experts, s.top_k)
    if s.num_tokens <= gemv_max_tokens:
        min_programs = MIN_PROGRAMS_PER_SM * s.num_sms
        gate_up = _gemv_kernel_shape(2, s.hidden, s.element_size, min_programs, s.intermediate,
                                     s.num_tokens * s.top_k)
        down = _gemv_kernel_shape(1 << (s.top_k - 1).bit_length(), s.intermediate, s.element_size, min_programs,
                                  s.hidden, s.num_tokens)
        return MoeLaunch("gemv", gate_up, down)
    rows = s.num_tokens * s.top_k / s.num_experts
    gate_up = _grouped_kernel_shape(rows, s.element_size, gated=True)
    down = {**_grouped_kernel_shape(rows, s.element_size, gated=False), "BLOCK_M": gate_up["BLOCK_M"]}
    return MoeLaunch("grouped", gate_up, down)


def load_table(path: Path = TABLE_PATH) -> dict[tuple, dict]:
    """{(experts, hidden, intermediate, top_k, SMs, element size): entry} from `path`; {} when it is missing, and
    {} with a warning when it cannot be read."""
    try:
        doc = json.loads(path.read_text())
        sms, size = int(doc["num_sms"]), int(doc["element_size"])
        return {(int(e["experts"]), int(e["hidden"]), int(e["intermediate"]), int(e["top_k"]), sms, size): e
                for e in doc["shapes"]}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring the MoE launch table {path}: {e!r}; the MoE kernels take their constants")
        return {}


@functools.cache
def _table() -> dict[tuple, dict]:
    return load_table()


def _nearest(entries: list[dict], num_tokens: int) -> dict:
    return min(entries, key=lambda e: (abs(math.log(e["tokens"]) - math.log(num_tokens)), e["tokens"]))


@functools.lru_cache(maxsize=None)
def moe_launch(shape: MoeShape) -> MoeLaunch:
    """The stored choice for `shape` where the table has its layer and device, else `fallback_launch`."""
    s = shape
    entry = _table().get((s.num_experts, s.hidden, s.intermediate, s.top_k, s.num_sms, s.element_size))
    if entry is None:
        return fallback_launch(shape)
    gemv_max_tokens = int(entry["gemv_max_tokens"])
    if s.num_tokens <= gemv_max_tokens and "gemv" in entry:
        return MoeLaunch("gemv", dict(entry["gemv"]["gate_up"]), dict(entry["gemv"]["down"]))
    if s.num_tokens > gemv_max_tokens and not entry.get("grouped") or s.num_tokens <= gemv_max_tokens:
        return fallback_launch(shape, gemv_max_tokens)
    best = _nearest(entry["grouped"], s.num_tokens)
    return MoeLaunch("grouped", dict(best["gate_up"]), dict(best["down"]))
