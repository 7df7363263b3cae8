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


def default_capture_sizes(max_num_tokens: int, max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """[1, 2, 4], then every 8 up to 248, then every 16, bounded by max_num_tokens and max_capture_size."""
    if max_num_tokens < 1:
        raise ValueError(f"max_num_tokens {max_num_tokens} must be at least 1")
    if max_capture_size < 1:
        raise ValueError(f"max_capture_size {max_capture_size} must be at least 1")
    limit = min(max_num_tokens, max_capture_size)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, limit + 1, 16))
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
