"""The fusion passes by name, and a digest of their code, without Inductor (ember.graphs.passes.pipeline, which
runs them inside Inductor, imports it): a warm start names its cache entry from this alone."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable

from torch.fx import Graph

import ember.kernels.fused_linear  # noqa: F401  (registers torch.ops.ember.fused_linear)
import ember.kernels.scaled_linear_op  # noqa: F401  (registers torch.ops.ember.scaled_linear)
import ember.kernels.qk_norm_rope  # noqa: F401  (registers torch.ops.ember.qk_norm_rope)
from ember.graphs.passes import (donate_residual, gated_epilogue, match, norm_prologue, qk_norm_rope,
                                 residual_all_reduce, residual_epilogue, sibling_linears)

# in the order they run: sibling projections merge first (as a native model packs them); the epilogue passes also
# extend linears that an earlier pass already fused
PASSES: dict[str, Callable[[Graph], int]] = {
    sibling_linears.NAME: sibling_linears.fuse_sibling_linears,
    norm_prologue.NAME: norm_prologue.fuse_rms_norm_prologue,
    gated_epilogue.NAME: gated_epilogue.fuse_silu_mul_epilogue,
    residual_epilogue.NAME: residual_epilogue.fuse_residual_epilogue,
    residual_all_reduce.NAME: residual_all_reduce.fuse_residual_into_all_reduce,
    qk_norm_rope.NAME: qk_norm_rope.fuse_qk_norm_rope,
}
# (residual donation runs after them on plain pieces: its code changes what a cold start saves too)
_SOURCES = (match, sibling_linears, norm_prologue, gated_epilogue, residual_epilogue, residual_all_reduce,
            qk_norm_rope, donate_residual, ember.kernels.fused_linear, ember.kernels.scaled_linear_op, ember.kernels.qk_norm_rope)


def check_pass_names(names: Iterable[str]) -> tuple[str, ...]:
    """The names, validated against the known passes ("all" stands for every pass)."""
    names = tuple(names)
    if "all" in names:
        return tuple(PASSES)
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise ValueError(f"fusion pass {unknown[0]!r} is not known; known passes: {list(PASSES)} (or 'all')")
    return names


def passes_digest(enabled: Iterable[str]) -> bytes:
    """Which passes run and their code: part of Inductor's cache key and of the compiled artifacts' folder name."""
    enabled = tuple(enabled)
    digest = hashlib.sha256(",".join(enabled).encode())
    if residual_all_reduce.NAME in enabled:        # its rewrite differs by rank
        digest.update(residual_all_reduce.rank_key().encode())
    for module in _SOURCES:
        digest.update(inspect.getsource(module).encode())
    return digest.digest()
