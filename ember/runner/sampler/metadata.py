"""`SamplingMetadata`: the per-step device tensors the batched sampler reads."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ember.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingMetadata:
    """Device tensors describing how to sample each of the N live requests of one step.

    Optional tensors are None when no request in the batch needs them, so the sampler skips that work.
    """
    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None            # [N] bool; only for mixed greedy/random batches
    temperature: torch.Tensor | None            # [N] float32; greedy rows hold 1.0; None when no scaling is needed
    top_k: torch.Tensor | None                  # [N] int64; vocab_size where disabled
    max_top_k: int                              # largest enabled top_k (0 when none)
    top_p: torch.Tensor | None                  # [N] float32
    min_p: torch.Tensor | None                  # [N] float32
    seeds: torch.Tensor                         # [N] int64
    output_lens: torch.Tensor                   # [N] int64: output tokens so far, the noise counter
    # penalties read which ids a request's tokens hold, [N, V] whatever its length (so a step's memory does not grow
    # with the context): the prompt's ids (repetition only), and how often each id was generated (any penalty)
    prompt_mask: torch.Tensor | None            # [N, V] bool
    output_counts: torch.Tensor | None          # [N, V] int32
    repetition_penalty: torch.Tensor | None     # [N] float32
    presence_penalty: torch.Tensor | None       # [N] float32
    frequency_penalty: torch.Tensor | None      # [N] float32
    blocked_token_ids: torch.Tensor | None      # [N, max_blocked] int64, padded with vocab_size (min_tokens)
    max_num_logprobs: int | None                # largest `logprobs` asked for in the batch; None: none asked
    # structured output: allowed tokens as bits (bit t of row j, word t // 32, set where token t may come), and per
    # request the bitmask row + 1 it samples under (0: none). None when no request of the step has a grammar
    bitmask: torch.Tensor | None = None         # [K, ceil(V / 32)] int32
    mask_index: torch.Tensor | None = None      # [N] int64

    @property
    def has_penalties(self) -> bool:
        """Whether any request uses a repetition, presence or frequency penalty."""
        return self.output_counts is not None

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], output_token_ids: list[list[int]],
              prompt_token_ids: list[list[int]], eos_token_ids: list[tuple[int, ...]], vocab_size: int,
              device: torch.device, bitmask: torch.Tensor | None = None,
              mask_index: list[int] | None = None) -> "SamplingMetadata":
        """Build the metadata from host lists (tests and the profile run; the engine's steps read the request
        table instead, see `ember.runner.sampling_inputs`); only the tensors some request needs are made.
        `bitmask` [K, ceil(V / 32)] int32 and `mask_index` (per request its bitmask row + 1, 0 for none) go
        together."""
        n = len(params)
        for name, values in (("seeds", seeds), ("output_token_ids", output_token_ids),
                             ("prompt_token_ids", prompt_token_ids), ("eos_token_ids", eos_token_ids)):
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries but there are {n} requests; give one per request")
        if n == 0:
            raise ValueError("SamplingMetadata.build got 0 requests; a step samples at least one")
        if vocab_size < 1:
            raise ValueError(f"vocab_size {vocab_size} must be at least 1")
        for s in seeds:
            if not 0 <= s < 2**63:
                raise ValueError(f"seed {s} must be in [0, 2**63)")
        device = torch.device(device)
        if (bitmask is None) != (mask_index is None):
            raise ValueError("give bitmask and mask_index together (or neither)")
        if mask_index is not None and len(mask_index) != n:
            raise ValueError(f"mask_index has {len(mask_index)} entries but there are {n} requests")

        def vec(values, dtype):
            return _to_device(torch.tensor(values, dtype=dtype), device)

        greedy = [p.temperature == 0.0 for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        greedy_mask = None if all_greedy or all_random else vec(greedy, torch.bool)

        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        if not all_greedy:
            temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
            if any(t != 1.0 for t in temps):
                temperature = vec(temps, torch.float32)
            # greedy rows get neutral values: their random draw is computed but discarded
            ks = [vocab_size if g or p.top_k < 0 or p.top_k >= vocab_size else p.top_k for g, p in zip(greedy, params)]
            ps = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
            mps = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
            if any(k < vocab_size for k in ks):
                top_k, max_top_k = vec(ks, torch.int64), max(k for k in ks if k < vocab_size)
            if any(v < 1.0 for v in ps):
                top_p = vec(ps, torch.float32)
            if any(v > 0.0 for v in mps):
                min_p = vec(mps, torch.float32)

        rep = [p.repetition_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        use_rep = any(r != 1.0 for r in rep)
        use_pres = any(v != 0.0 for v in pres)
        use_freq = any(v != 0.0 for v in freq)
        use_penalties = use_rep or use_pres or use_freq

        out_lens = [len(out) for out in output_token_ids]
        blocked = [
            (tuple(eos) + tuple(p.stop_token_ids)) if n_out < p.min_tokens else ()
            for p, n_out, eos in zip(params, out_lens, eos_token_ids)
        ]
        for row in blocked:
            for t in row:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop/eos token id {t} is outside the vocabulary of size {vocab_size}")

        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_reqs=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=vec(seeds, torch.int64),
            output_lens=vec(out_lens, torch.int64),
            prompt_mask=token_counts(_padded(prompt_token_ids, vocab_size, device), vocab_size, torch.bool)
            if use_rep else None,
            output_counts=token_counts(_padded(output_token_ids, vocab_size, device), vocab_size)
            if use_penalties else None,
            repetition_penalty=vec(rep, torch.float32) if use_rep else None,
            presence_penalty=vec(pres, torch.float32) if use_pres else None,
            frequency_penalty=vec(freq, torch.float32) if use_freq else None,
            blocked_token_ids=_padded(blocked, vocab_size, device) if any(blocked) else None,
            max_num_logprobs=max(logprob_counts) if logprob_counts else None,
            bitmask=bitmask.to(device) if bitmask is not None else None,
            mask_index=vec(mask_index, torch.int64) if mask_index is not None else None,
        )


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without blocking the host (pinned staging on CUDA)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.int32,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, V] `dtype`: how often each id occurs in each row of `token_ids` [N, W] int64 (bool: whether it does);
    the pad id `vocab_size` counts in an extra column that is dropped. With `out` ([N, V + 1] of `dtype`, as a
    call without it returns before the slice), the counts are added to it, so that a long row can be counted a
    chunk of columns at a time."""
    if out is None:
        out = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=dtype, device=token_ids.device)
    if out.dtype == torch.bool:
        out.scatter_(1, token_ids, True)
    else:
        out.scatter_add_(1, token_ids, torch.ones(token_ids.shape, dtype=out.dtype, device=out.device))
    return out[:, :vocab_size]


def _padded(rows: list, pad_id: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids as one [N, max_len] int64 tensor, padded with the out-of-range id `pad_id`."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    width = max(int(lens.max()), 1)   # at least one column so scatter has something to index
    flat = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    out = torch.full((len(rows), width), pad_id, dtype=torch.int64)   # [N, max_len]
    out[torch.arange(width)[None, :] < lens[:, None]] = flat
    return _to_device(out, device)
