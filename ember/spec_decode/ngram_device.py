"""Prompt-lookup (n-gram) proposals on the device, from the request table's token ids: no host sync, so a step
that needs them can be launched before the last step's tokens reach the host, and the work captures in a graph.

The rule is the host proposer's (`NgramProposer`): n from `prompt_lookup_max` down to `prompt_lookup_min`, the first
n whose last n tokens occur earlier (among the last `lookback` tokens) wins; among its matches, the latest followed
by k whole tokens, else the earliest; the k tokens after it are proposed, -1 where the history ends first.

Two implementations of the search, one result: a Triton kernel (CUDA, and the CPU tests under the interpreter) with
one program per (request, n) that scans only the request's own history, and torch ops over the table's whole
lookback window (the CPU, where the table is short and a kernel launch is not cheaper)."""

from __future__ import annotations

import functools

import torch

LOOKBACK = 4096          # the host proposer's default: the tokens searched, so a long context costs a bounded scan
_NONE = 1 << 30          # "no match" for the earliest-match search (past any position)


def propose_ngram(token_ids: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, k: int, n_min: int,
                  n_max: int, lookback: int = LOOKBACK, use_triton: bool | None = None) -> torch.Tensor:
    """[R, k] int64 proposals for the table rows `rows` [R] holding `counts` [R] tokens each (`token_ids`
    [num_rows, width], any int dtype); -1 marks no proposal. use_triton: None picks Triton for CUDA tensors."""
    if use_triton is None:
        use_triton = token_ids.is_cuda
    search = _search_triton if use_triton else _search_torch
    latest, earliest = search(token_ids, rows, counts, k, n_min, n_max, lookback)
    return _proposals(token_ids, rows, counts, latest, earliest, k, n_min, n_max)


def _proposals(token_ids, rows, counts, latest, earliest, k, n_min, n_max) -> torch.Tensor:
    """The tokens after the winning match: the longest n with a match, its latest whole one, else its earliest."""
    R = rows.shape[0]
    start = torch.zeros(R, dtype=torch.int64, device=rows.device)
    found = torch.zeros(R, dtype=torch.bool, device=rows.device)
    for n in range(n_max, n_min - 1, -1):                         # longest first: the first n found wins
        c = n - n_min
        hit = earliest[:, c] < _NONE
        pick = torch.where(latest[:, c] >= 0, latest[:, c], earliest[:, c]) + n
        start = torch.where(hit & ~found, pick, start)
        found |= hit
    pos = start[:, None] + torch.arange(k, device=rows.device)                     # [R, k]
    ok = found[:, None] & (pos < counts[:, None])
    width = token_ids.shape[1]
    tokens = token_ids[rows[:, None], pos.clamp(max=width - 1)].to(torch.int64)
    return torch.where(ok, tokens, -1)


def _search_torch(token_ids, rows, counts, k, n_min, n_max, lookback):
    """(latest whole match [R, N], earliest match [R, N]) per n = n_min..n_max, by absolute start position (-1 and
    `_NONE` for none), over each request's last `lookback` tokens."""
    width = token_ids.shape[1]
    span = min(lookback, width)
    lo = (counts - lookback).clamp(min=0)                                          # [R]
    pos = lo[:, None] + torch.arange(span, device=rows.device)                     # [R, span]: absolute positions
    hist = token_ids[rows[:, None], pos.clamp(max=width - 1)].to(torch.int64)      # [R, span]
    length = counts - lo                                                           # L: the tokens searched
    latest, earliest = [], []
    for n in range(n_min, n_max + 1):
        starts = torch.arange(span, device=rows.device)                            # relative window starts
        m = (starts[None, :] < (length - n)[:, None]) & (length[:, None] >= n + 1)
        for j in range(n):
            suffix = hist.gather(1, (length - n + j).clamp(min=0, max=span - 1)[:, None])     # [R, 1]
            shifted = torch.nn.functional.pad(hist[:, j:], (0, j), value=-1)                 # [R, span]
            m &= shifted == suffix
        whole = m & (starts[None, :] + n + k <= length[:, None])
        absolute = starts[None, :] + lo[:, None]
        latest.append(torch.where(whole, absolute, -1).amax(dim=1))
        earliest.append(torch.where(m, absolute, _NONE).amin(dim=1))
    return torch.stack(latest, 1), torch.stack(earliest, 1)


def _search_triton(token_ids, rows, counts, k, n_min, n_max, lookback):
    R, N = rows.shape[0], n_max - n_min + 1
    latest = torch.empty(R, N, dtype=torch.int64, device=rows.device)
    earliest = torch.empty(R, N, dtype=torch.int64, device=rows.device)
    if R:
        _kernel(not token_ids.is_cuda)[(R, N)](
            token_ids, token_ids.stride(0), rows, counts, latest, earliest, k, n_min, lookback,
            N_MAX=n_max, BLOCK=128, NONE=_NONE)
    return latest, earliest


@functools.cache
def _kernel(interpreted: bool):
    """The search kernel, compiled, or for CPU tensors an interpreted copy."""
    from ember.spec_decode.ngram_triton import ngram_search_kernel as kernel
    if not interpreted:
        return kernel
    from ember.kernels.interpret import interpreted as interpreted_copy
    return interpreted_copy(kernel)
