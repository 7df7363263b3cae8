"""The one place that decides how a step runs: (batch stats, backends' CUDA-graph support) -> (mode, descriptor).

API:
    resolve_modes(compile_config, device, backends) -> ResolvedModes     once at start-up; logs every downgrade
    ResolvedModes(compile_mode, cudagraph_mode, support, reasons)
    CudaGraphDispatcher(cudagraph_mode, capture_sizes, max_num_seqs, support=CudaGraphSupport.ALWAYS,
                        short_context_len=None, verify_query_len=None, max_num_tokens=None)
    dispatcher.dispatch(num_tokens, num_reqs, uniform_decode, max_seq_len=None, max_query_len=None)
        -> (CUDAGraphMode, BatchDescriptor)
    dispatcher.capture_list() -> list[(CUDAGraphMode, BatchDescriptor)]  what to capture, largest first

Resolution (requested mode x backend support), after CPU / enforce_eager (both: NONE, and enforce_eager also
turns compilation off):
    NEVER:                        FULL, FULL_AND_PIECEWISE -> PIECEWISE;  FULL_DECODE_ONLY -> NONE
    UNIFORM_SINGLE_TOKEN_DECODE,
    UNIFORM_BATCH:                FULL -> FULL_AND_PIECEWISE  (full graphs only for uniform decode)
    ALWAYS:                       FULL_AND_PIECEWISE -> FULL  (every bucketed batch gets a full graph)
Without compiled pieces (compile_mode "none") a mode with PIECEWISE cannot run: an explicitly requested PIECEWISE
or FULL_AND_PIECEWISE raises ValueError; one reached from "auto" or by a downgrade becomes FULL_DECODE_ONLY (when
the backends allow it) or NONE, with the reason logged.

Verify buckets (speculative decoding, `verify_query_len` = k + 1): a step whose requests each bring at most k + 1
query tokens, at least one of them more than one, takes a FULL graph of R request rows and R x (k + 1) tokens, R
padded to the next decode size, where the backends support ALWAYS, or UNIFORM_BATCH when every request brings
exactly k + 1 tokens (a mixed bucket would pad the rows to its token count, and attention would plan its query
tile for one-token queries). Other steps, and every step under UNIFORM_SINGLE_TOKEN_DECODE, take the mixed path.
`VERIFY_BUCKETS` (off by default: measured slower) turns them on.

Short-context decode graphs: where the attention builders plan other kernels for a uniform-decode bucket whose
requests are all short (`short_context_len(num_reqs)`, e.g. triton_unified's one-pass decode kernel instead of
split-KV and its reduce), that bucket has a second FULL graph, keyed by `max_seq_len`, and a step takes it when
its longest request fits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ember.attention_backends.base import AttentionBackend, CudaGraphSupport
from ember.graphs.buckets import decode_capture_sizes, pad_to_bucket, validate_capture_sizes
from ember.graphs.compile import resolve_compile_mode
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode

logger = logging.getLogger("ember")

M = CUDAGraphMode

# FULL graphs of verify steps by request count (see the module docstring). Off: on an H100 (Llama-3.1-8B config,
# k = 4, acceptance length 3.0) the mixed-batch FULL graphs ran speculation 2-6% faster at batch 1, 8 and 32
# (369 / 2,602 / 6,968 against 349 / 2,551 / 6,819 tok/s, benches/spec_decode.py --verify-buckets on off)
VERIFY_BUCKETS = False


@dataclass(frozen=True)
class ResolvedModes:
    """What start-up settled on: the compile mode, the CUDA-graph mode, the support level it assumed, and why."""
    compile_mode: str                 # "none" | "default"
    cudagraph_mode: CUDAGraphMode
    support: CudaGraphSupport         # the minimum over the KV-cache groups' backends
    reasons: tuple[str, ...] = ()     # one line per downgrade, in order


def min_support(backends: Sequence[type[AttentionBackend]]) -> tuple[CudaGraphSupport, str]:
    """The weakest CUDA-graph support among the backends, and the name of a backend that has it."""
    if not backends:
        return CudaGraphSupport.ALWAYS, "no attention"
    weakest = min(backends, key=lambda b: b.cudagraph_support)
    return CudaGraphSupport(weakest.cudagraph_support), weakest.name


def _downgrade_for_support(mode: CUDAGraphMode, support: CudaGraphSupport, who: str) -> tuple[CUDAGraphMode, str]:
    why = f"{who} supports CUDA graphs {support.name}"
    if support == CudaGraphSupport.NEVER:
        target = {M.FULL: M.PIECEWISE, M.FULL_AND_PIECEWISE: M.PIECEWISE, M.FULL_DECODE_ONLY: M.NONE}.get(mode, mode)
    elif support == CudaGraphSupport.ALWAYS:
        target = M.FULL if mode == M.FULL_AND_PIECEWISE else mode
        why = f"{who} supports CUDA graphs ALWAYS, so every bucketed batch runs a full graph"
    else:
        target = M.FULL_AND_PIECEWISE if mode == M.FULL else mode
    return target, (f"{why}: {mode.name} -> {target.name}" if target != mode else "")


def resolve_modes(compile_config, device: torch.device | str,
                  backends: Sequence[type[AttentionBackend]]) -> ResolvedModes:
    """Settle compile and CUDA-graph modes from an `ember.config.CompileConfig`, the device and the backends.

    Logs the outcome and every downgrade with its reason (e.g. "torch_ref supports CUDA graphs NEVER:
    FULL_AND_PIECEWISE -> PIECEWISE").
    """
    device = torch.device(device)
    support, who = min_support(backends)
    compile_mode = resolve_compile_mode(compile_config.compile_mode, device, compile_config.enforce_eager)
    requested_name = str(compile_config.cudagraph_mode.value if isinstance(compile_config.cudagraph_mode, M)
                         else compile_config.cudagraph_mode).lower()
    explicit = requested_name != "auto"
    requested = M.parse(compile_config.cudagraph_mode)
    reasons: list[str] = []

    if compile_config.enforce_eager:
        mode = M.NONE
        if requested != M.NONE:
            reasons.append(f"enforce_eager: {requested.name} -> NONE, no compilation")
    elif device.type != "cuda":
        mode = M.NONE
        if requested != M.NONE:
            reasons.append(f"CUDA graphs need a CUDA device, not {device.type}: {requested.name} -> NONE")
    else:
        mode, why = _downgrade_for_support(requested, support, who)
        if why:
            reasons.append(why)
        if compile_mode == "none" and mode.has_piecewise:
            if explicit and requested.has_piecewise:
                raise ValueError(f"cudagraph_mode {requested.name} needs the piecewise-compiled model, but "
                                 f"compile_mode is 'none'; set compile_mode to 'default' or choose FULL_DECODE_ONLY, "
                                 f"FULL or NONE")
            target = M.FULL_DECODE_ONLY if (mode == M.FULL_AND_PIECEWISE
                                            and support >= CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE) else M.NONE
            reasons.append(f"compile_mode 'none' has no compiled pieces to capture: {mode.name} -> {target.name}")
            mode = target

    for line in reasons:
        logger.info("cudagraph mode: %s", line)
    logger.info("compile mode %s, cudagraph mode %s (attention CUDA-graph support %s via %s)",
                compile_mode, mode.name, support.name, who)
    return ResolvedModes(compile_mode, mode, support, tuple(reasons))


class CudaGraphDispatcher:
    """Maps a step to (runtime mode, descriptor); the descriptor's sizes are what the runner pads the batch to.

    Runtime modes: FULL (replay the whole forward; pad tokens and requests to the descriptor), PIECEWISE (replay
    each compiled piece; pad tokens only, attention runs on the live requests), NONE (run as is, no padding).
    """

    def __init__(self, cudagraph_mode: CUDAGraphMode, capture_sizes: Sequence[int], max_num_seqs: int,
                 support: CudaGraphSupport = CudaGraphSupport.ALWAYS, pad_piecewise_reqs: bool = False,
                 short_context_len: Callable[[int], int | None] | None = None, verify_query_len: int | None = None,
                 max_num_tokens: int | None = None):
        self.mode = CUDAGraphMode.parse(cudagraph_mode)
        # PIECEWISE descriptors that pad the request rows as FULL ones do: a model whose last layers run on one row
        # per request (a prefill-skipping tail) needs a row count fixed per bucket for those layers' graphs
        self.pad_piecewise_reqs = pad_piecewise_reqs
        self.support = CudaGraphSupport(support)
        self.max_num_seqs = max_num_seqs
        if self.mode == M.NONE:
            self.sizes: tuple[int, ...] = ()
        else:
            # the upper bound (max_num_batched_tokens) was checked by resolve_capture_sizes
            self.sizes = validate_capture_sizes(capture_sizes, max(capture_sizes, default=1))
        self.decode_sizes = decode_capture_sizes(self.sizes, max_num_seqs) if self.sizes else ()
        if self.mode == M.FULL and self.support != CudaGraphSupport.ALWAYS:
            raise ValueError(f"cudagraph mode FULL needs attention CUDA-graph support ALWAYS, not {self.support.name}; "
                             f"resolve the mode with resolve_modes() first")
        if self.mode.has_full and self.support == CudaGraphSupport.NEVER:
            raise ValueError(f"cudagraph mode {self.mode.name} captures attention, but its CUDA-graph support is "
                             f"NEVER; resolve the mode with resolve_modes() first")
        # uniform-decode batches take a FULL graph in every mode that has one
        self._full_decode = self.mode.has_full
        # decode bucket -> the request length up to which it has a short-context graph as well
        self.short_decode: dict[int, int] = {}
        if self._full_decode and short_context_len is not None:
            for size in self.decode_sizes:
                bound = short_context_len(min(size, max_num_seqs))
                if bound is not None:
                    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
                        raise ValueError(f"short_context_len({size}) returned {bound!r}, not a positive length")
                    self.short_decode[size] = bound
        # no step of more requests than this can take a short-context graph
        self.short_decode_max_reqs = max(self.short_decode, default=0)
        self._full_mixed = self.mode == M.FULL
        self._piecewise_mixed = self.mode.has_piecewise
        # verify buckets: request counts R whose R x verify_query_len tokens fit a step
        self.verify_query_len = verify_query_len
        self.verify_sizes: tuple[int, ...] = ()
        if (VERIFY_BUCKETS and verify_query_len is not None and verify_query_len > 1 and self._full_decode
                and self.support >= CudaGraphSupport.UNIFORM_BATCH):
            limit = max_num_tokens if max_num_tokens is not None else max(self.sizes, default=0)
            self.verify_sizes = tuple(s for s in self.decode_sizes if s * verify_query_len <= limit)

    def _full_desc(self, bucket: int, uniform_decode: bool, max_seq_len: int | None = None) -> BatchDescriptor:
        # a bucket of T tokens holds at most T requests, and never more than the request rows that exist
        return BatchDescriptor(bucket, min(bucket, self.max_num_seqs), uniform_decode, max_seq_len)

    def _piecewise_desc(self, bucket: int) -> BatchDescriptor:
        return BatchDescriptor(bucket, min(bucket, self.max_num_seqs) if self.pad_piecewise_reqs else None)

    def _verify_desc(self, reqs: int) -> BatchDescriptor:
        return BatchDescriptor(reqs * self.verify_query_len, reqs, False)

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool,
                 max_seq_len: int | None = None, max_query_len: int | None = None
                 ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and padded descriptor for a step of `num_tokens` tokens over `num_reqs` requests whose
        longest is `max_seq_len` tokens (None: unknown, which never takes a short-context graph) and whose largest
        query is `max_query_len` tokens (None: unknown, which never takes a verify bucket)."""
        if (self.verify_sizes and max_query_len is not None and 1 < max_query_len <= self.verify_query_len
                and num_reqs <= self.verify_sizes[-1]
                # UNIFORM_BATCH promises graphs of uniform batches only: every request k + 1 tokens
                and (self.support == CudaGraphSupport.ALWAYS or num_tokens == num_reqs * self.verify_query_len)):
            return M.FULL, self._verify_desc(pad_to_bucket(num_reqs, self.verify_sizes))
        if self._full_decode and uniform_decode and num_tokens == num_reqs:
            bucket = pad_to_bucket(num_tokens, self.decode_sizes) if self.decode_sizes else None
            if bucket is not None:
                bound = self.short_decode.get(bucket)
                fits = bound is not None and max_seq_len is not None and max_seq_len <= bound
                return M.FULL, self._full_desc(bucket, True, bound if fits else None)
        if self._full_mixed or self._piecewise_mixed:
            bucket = pad_to_bucket(num_tokens, self.sizes)
            if bucket is not None:
                if self._full_mixed:
                    return M.FULL, self._full_desc(bucket, False)
                return M.PIECEWISE, self._piecewise_desc(bucket)
        return M.NONE, BatchDescriptor(num_tokens, None, uniform_decode)

    def capture_list(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (runtime mode, descriptor) the dispatcher can return with a graph, largest first (so smaller graphs
        reuse the shared pool's memory)."""
        out: list[tuple[CUDAGraphMode, BatchDescriptor]] = []
        if self._full_decode:
            out += [(M.FULL, self._full_desc(s, True)) for s in self.decode_sizes]
            out += [(M.FULL, self._full_desc(s, True, bound)) for s, bound in self.short_decode.items()]
        if self._full_mixed:
            out += [(M.FULL, self._full_desc(s, False)) for s in self.sizes]
        elif self._piecewise_mixed:
            out += [(M.PIECEWISE, self._piecewise_desc(s)) for s in self.sizes]
        # a verify bucket of max_num_seqs rows may be a mixed bucket's descriptor too: captured once
        out += [(M.FULL, self._verify_desc(s)) for s in self.verify_sizes if (M.FULL, self._verify_desc(s)) not in out]
        return sorted(out, key=lambda md: (-md[1].num_tokens, md[0].value, md[1].uniform_decode,
                                           md[1].max_seq_len or 0))
