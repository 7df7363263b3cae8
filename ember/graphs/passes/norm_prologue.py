"""RMSNorm as the prologue of the projection it feeds: `linear(rms_norm(x))` -> `fused_linear(x, norm_weight=...)`.

The normed activations are never written: at decode, the GEMV sums the squares of its few rows itself and norms each
tile of x as it loads it. The norm's input (the residual stream) usually has other users and stays as it is.
"""

from __future__ import annotations

import torch
from torch.fx import Graph

from ember.graphs.passes.match import (LinearCall, match_rms_norm, replace_with, same_rows, unit_view_source, value,
                                       with_rank)

NAME = "rms_norm_prologue"


def fuse_rms_norm_prologue(graph: Graph) -> int:
    """Rewrite every linear whose input is a Llama-form RMSNorm of a 2-D tensor (or of one with leading size-1
    dims, as transformers code runs it); returns how many."""
    count = 0
    for node in list(graph.nodes):
        call = LinearCall.of(node)
        if call is None or call.norm_weight is not None:
            continue
        norm = match_rms_norm(unit_view_source(call.x))
        x_val, in_val = (value(norm.x), value(call.x)) if norm is not None else (None, None)
        if x_val is None or in_val is None or in_val.dim() != 2 or not same_rows(x_val, in_val):
            continue
        call.x, call.norm_weight, call.eps = with_rank(graph, norm.x, 2, before=node), norm.weight, norm.eps
        replace_with(graph, node, call.target, call.args(), call.fake)
        graph.erase_node(node)
        count += 1
    return count
