"""Capture sizes ("buckets") and padding a batch to one; pure functions.

API:
    default_capture_sizes(max_num_tokens, max_capture_size=512) -> tuple[int, ...]
    validate_capture_sizes(sizes, max_num_tokens) -> tuple[int, ...]        sorted, deduplicated, checked
    resolve_capture_sizes(requested, max_num_tokens) -> tuple[int, ...]     the configured sizes, or the default
    decode_capture_sizes(sizes, max_num_seqs) -> tuple[int, ...]            the buckets uniform-decode batches use
    pad_to_bucket(num_tokens, sizes) -> int | None                          smallest bucket >= num_tokens, or None
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

# Capturing every multiple of 16 up to max_num_batched_tokens (8192 by default) would take hundreds of graphs;
# large prefills are dominated by their GEMMs, where a graph saves nothing, so buckets stop here unless asked.
DEFAULT_MAX_CAPTURE_SIZE = 512

# Each bucket costs start-up time (a warm-up step and a capture: 43 ms on a warm start, 0.4 s on a cold one, whose
# Triton compiles dominate) and graph-pool memory; padding a batch to the next bucket costs step time on every step.
# FULL-graph step time per bucket, Qwen3-0.6B bf16 on an H100 (benches/startup.py --replay-table), in ms:
#   decode  1: 1.14   4: 1.45   8: 1.49  16: 1.67  32: 2.00  48: 2.18  64: 2.41  80: 2.80  96: 3.04
#         112: 3.34 128: 3.46 160: 3.48 192: 3.56 224: 3.64 256: 3.66
#   mixed 256: 3.66 320: 3.78 384: 3.79 448: 3.96 512: 3.98
# Up to 128 tokens the step grows ~15 us per token, so a step of 8 keeps padding under ~4% (a step of 16 costs up
# to 8%, far more over a serving run than the 0.3 s those buckets take to capture); above 128 the step time is flat
# within 5%, so coarse buckets lose little there. 27 sizes (50 descriptors with decode) instead of 51 (86).
DEFAULT_CAPTURE_SIZES = ((1, 2, 4) + tuple(range(8, 129, 8)) + (160, 192, 224, 256, 320, 384, 448, 512))
LARGE_BUCKET_STEP = 64     # beyond the list, when a larger max_capture_size is asked for


def default_capture_sizes(max_num_tokens: int, max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """DEFAULT_CAPTURE_SIZES, then every 64, bounded by max_num_tokens and max_capture_size."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens {max_num_tokens} must be at least 1")
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size {max_capture_size} must be at least 1")
    limit = min(max_num_tokens, max_capture_size)
    top = DEFAULT_CAPTURE_SIZES[-1]
    sizes = list(DEFAULT_CAPTURE_SIZES) + list(range(top + LARGE_BUCKET_STEP, limit + 1, LARGE_BUCKET_STEP))
    return tuple(s for s in sizes if s <= limit)


def validate_capture_sizes(sizes: Iterable[int], max_num_tokens: int) -> tuple[int, ...]:
    """Sorted unique sizes; each must be a positive int no larger than max_num_tokens (the token buffers' length)."""
    out = sorted(set(sizes))
    if not out:
        raise ValueError("cudagraph_capture_sizes is empty; give at least one size or leave it unset for the default")
    for s in out:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"capture size {s!r} must be a positive integer")
        if s > max_num_tokens:
            raise ValueError(f"capture size {s} exceeds max_num_batched_tokens {max_num_tokens}; "
                             f"drop it or raise max_num_batched_tokens")
    return tuple(out)


def resolve_capture_sizes(requested: Iterable[int] | None, max_num_tokens: int) -> tuple[int, ...]:
    """`CompileConfig.cudagraph_capture_sizes` validated, or the default sizes when it is None."""
    if requested is None:
        return default_capture_sizes(max_num_tokens)
    return validate_capture_sizes(requested, max_num_tokens)


def decode_capture_sizes(sizes: Sequence[int], max_num_seqs: int) -> tuple[int, ...]:
    """Buckets for uniform-decode batches, where a bucket of T tokens is also T requests.

    Sizes above max_num_seqs are dropped (no more request rows exist); max_num_seqs itself is added when a larger
    size was dropped, so that a full batch of decodes still has a bucket.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs {max_num_seqs} must be at least 1")
    kept = [s for s in sizes if s <= max_num_seqs]
    if any(s > max_num_seqs for s in sizes) and max_num_seqs not in kept:
        kept.append(max_num_seqs)
    return tuple(sorted(kept))


def pad_to_bucket(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= num_tokens in the sorted `sizes`, or None beyond the largest (no graph for that batch)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens {num_tokens} must be at least 1")
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None
