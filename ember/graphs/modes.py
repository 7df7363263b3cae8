"""CUDA-graph modes and the hashable batch descriptor that keys every captured graph.

API:
    CUDAGraphMode.parse(name) -> CUDAGraphMode        "auto" is FULL_AND_PIECEWISE
    mode.has_full / mode.has_piecewise                  which kinds of graph a (resolved) mode may dispatch to
    BatchDescriptor(num_tokens, num_reqs, uniform_decode, max_seq_len=None)
    desc.padded_num_reqs(live_num_reqs) -> int         the request count the runner pads the batch to

A *configured* mode (what the engine resolves at start-up) may be any member; the *runtime* mode of one step
(what the dispatcher returns and the forward context carries) is only NONE, PIECEWISE or FULL.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CUDAGraphMode(enum.Enum):
    """How the forward pass is run under CUDA graphs."""
    NONE = "none"                              # no graphs: compiled pieces (or the eager model) run directly
    PIECEWISE = "piecewise"                    # one graph per compiled piece and bucket; attention eager in between
    FULL = "full"                              # one graph per bucket around the whole forward, attention included
    FULL_DECODE_ONLY = "full_decode_only"      # FULL for uniform-decode batches, no graph otherwise
    FULL_AND_PIECEWISE = "full_and_piecewise"  # FULL for uniform-decode batches, PIECEWISE for the rest

    @classmethod
    def parse(cls, value: "str | CUDAGraphMode") -> "CUDAGraphMode":
        """A mode from its name (any case) or itself; "auto" means the default, FULL_AND_PIECEWISE."""
        if isinstance(value, CUDAGraphMode):
            return value
        name = str(value).strip().lower()
        if name == "auto":
            return cls.FULL_AND_PIECEWISE
        for mode in cls:
            if mode.value == name:
                return mode
        raise ValueError(f"cudagraph_mode {value!r} is not known; use 'auto' or one of {[m.value for m in cls]}")

    @property
    def has_full(self) -> bool:
        """Whether some steps may replay a full-forward graph."""
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        """Whether some steps may replay per-piece graphs (this needs the piecewise-compiled model)."""
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


@dataclass(frozen=True)
class BatchDescriptor:
    """The padded shape of one step, and the key of its CUDA graph.

    num_tokens: tokens after padding to the bucket (the live count when no graph runs).
    num_reqs: requests after padding for FULL graphs, whose attention kernels see every request row;
        None for PIECEWISE and NONE, where attention runs eagerly on the live requests.
    uniform_decode: every live request is a single-token decode (FULL graphs of such batches may pick a
        decode-only kernel, so they are captured separately from mixed ones).
    max_seq_len: for a short-context uniform-decode graph, the longest request (context + new token) it serves;
        None: any length. Attention may plan other kernels for a bucket whose requests are all this short (the
        dispatcher picks such a graph only when every live request fits).
    """
    num_tokens: int
    num_reqs: int | None = None
    uniform_decode: bool = False
    max_seq_len: int | None = None

    def padded_num_reqs(self, live_num_reqs: int) -> int:
        """How many request rows the runner fills: the descriptor's count if it pads requests, else the live one."""
        return live_num_reqs if self.num_reqs is None else self.num_reqs
