"""Batched sampling on the device: penalties, greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every request of a step is sampled in one pass over the [N, V] logits, with no host sync. Random draws use
counter-based noise: a splitmix64 hash of (seed, output position, token id) computed in int64 tensor ops, so a
request's token depends only on its own logits, seed and position, never on its batch mates or its row.

On CUDA the same noise comes from Triton kernels (`ember.kernels.sampling`): without top-k/top-p/min-p one kernel pass
over the logits samples every row; the torch code here stays the CPU path and the reference.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ember.runner.sampler.metadata import SamplingMetadata

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "apply_filters", "apply_penalties", "apply_top_k_top_p", "apply_min_p",
           "apply_token_bitmask", "random_bits", "gumbel_noise"]


@dataclass
class SamplerOutput:
    """What the sampler returns for one step; all tensors stay on the device until the engine copies them."""
    sampled_token_ids: torch.Tensor           # [N] int64
    logprob_token_ids: torch.Tensor | None    # [N, 1 + max_logprobs] int64: sampled token, then the top-k ids
    logprobs: torch.Tensor | None             # [N, 1 + max_logprobs] float32
    ranks: torch.Tensor | None                # [N] int64: rank of the sampled token (1 = most likely)


class Sampler(nn.Module):
    """Samples one token per request from [N, V] logits as described by a `SamplingMetadata`.

    use_triton: None picks the Triton kernels for CUDA logits when Triton is installed; True forces them (CPU
    tensors then run interpreted, for tests); False keeps the torch ops. Both give the same tokens.
    """

    def __init__(self, use_triton: bool | None = None):
        super().__init__()
        self.use_triton = use_triton

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample the next token of every request; logprobs come from the logits as they are, as vLLM does by
        default (with a grammar, after its bitmask: what it forbids has logprob -inf)."""
        if logits.dim() != 2 or logits.shape[0] != meta.num_reqs or logits.shape[1] != meta.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the sampling metadata "
                             f"[num_reqs={meta.num_reqs}, vocab_size={meta.vocab_size}]")
        if not logits.is_floating_point():
            raise ValueError(f"logits dtype {logits.dtype} must be a floating-point type")
        kernels = self._kernels(logits)
        has_filters = meta.top_k is not None or meta.top_p is not None or meta.min_p is not None
        one_pass = kernels is not None and not has_filters
        wants_logprobs = meta.max_num_logprobs is not None
        # the one-pass kernel reads the caller's logits in their own dtype unless something must change them first
        needs_copy = (not one_pass or meta.has_penalties or meta.blocked_token_ids is not None
                      or logits.dtype not in _KERNEL_LOGITS_DTYPES)
        masked = meta.bitmask is not None
        # the one-pass kernel applies a grammar's bitmask as it reads; any other path applies it to its copy first
        copied = masked and (needs_copy or wants_logprobs)
        if copied:
            # a private float32 copy: the steps below work in place and the caller's logits stay untouched
            logits = logits.to(torch.float32, copy=True)                 # [N, V]
            apply_token_bitmask(logits, meta.bitmask, meta.mask_index, kernels)
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if wants_logprobs else None   # [N, V]

        # greedy rows with nothing to apply take the argmax of the caller's logits as they are: no copy to make
        argmax_only = (kernels is None and meta.all_greedy and not meta.has_penalties
                       and meta.blocked_token_ids is None)
        if not argmax_only and needs_copy:
            if not copied:
                logits = logits.to(torch.float32, copy=True)             # [N, V]
            logits = apply_penalties(logits, meta)
            if meta.blocked_token_ids is not None:
                logits.masked_fill_(_token_mask(meta.blocked_token_ids, meta.vocab_size), float("-inf"))
        if one_pass:
            fused = masked and not copied
            sampled = kernels.sample_triton(logits, meta.temperature, meta.seeds, meta.output_lens,
                                            meta.greedy_mask, meta.all_greedy,
                                            meta.bitmask if fused else None, meta.mask_index if fused else None)
        else:
            noise = gumbel_noise if kernels is None else kernels.gumbel_noise_triton
            sampled = self._sample(logits, meta, noise)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, ranks)

    def _kernels(self, logits: torch.Tensor):
        """The `ember.kernels.sampling` module when this call uses Triton, else None."""
        if self.use_triton is False or (self.use_triton is None and not logits.is_cuda):
            return None
        if not _triton_installed():
            if self.use_triton:
                raise RuntimeError("Sampler(use_triton=True) needs the triton package; install it or pass "
                                   "use_triton=None to fall back to the torch sampler")
            return None
        return _kernel_module()

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata,
                noise: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
        """Greedy rows take the argmax; random rows race counter-based noise (default `gumbel_noise`) over the
        filtered logits."""
        greedy = None if meta.all_random else logits.argmax(dim=-1)   # [N]
        if meta.all_greedy:
            return greedy
        logits = apply_filters(logits, meta)
        # Gumbel-max: argmax(l + G) with G = -log(E), E ~ Exp(1), is the exponential race argmax(p / E)
        logits.add_((noise or gumbel_noise)(meta.seeds, meta.output_lens, meta.vocab_size))
        sampled = logits.argmax(dim=-1)                                # [N]
        if greedy is None:
            return sampled
        return torch.where(meta.greedy_mask, greedy, sampled)


_KERNEL_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what sample_triton reads directly


@functools.cache
def _kernel_module():
    return importlib.import_module("ember.kernels.sampling")


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor, kernels=None) -> None:
    """In place on float32 `logits` [N, V]: -inf where row i's grammar forbids the token (bit t % 32 of word t // 32
    of bitmask row mask_index[i] - 1); rows with mask_index 0 keep every token. `kernels`: the Triton module, else
    torch ops (the CPU path and the reference)."""
    if kernels is not None:
        kernels.apply_token_bitmask_triton(logits, bitmask, mask_index)
        return
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)                 # [32]
    if logits.device.type == "cpu":
        # only the rows with a grammar (finding them costs nothing on the CPU: no device to wait for)
        rows = torch.nonzero(mask_index > 0).flatten()
        if rows.numel() == 0:
            return
        words = bitmask[mask_index[rows] - 1]                                          # [n, W]
        forbidden = ((words.unsqueeze(-1) >> shifts) & 1).view(rows.numel(), -1)[:, :vocab_size] == 0
        logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))
        return
    words = bitmask[(mask_index - 1).clamp(min=0)]                                     # [N, W]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab_size]   # [N, V]
    logits.masked_fill_((allowed == 0) & (mask_index > 0)[:, None], float("-inf"))


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool, True at the ids listed per row; the pad id vocab_size lands in a dropped extra column."""
    mask = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    return mask.scatter_(1, token_ids, True)[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM, prompt + output tokens) then presence and frequency (OpenAI, output tokens only)."""
    if not meta.has_penalties:
        return logits
    vocab_size = meta.vocab_size
    if meta.repetition_penalty is not None:
        seen = meta.output_counts > 0                                # [N, V]
        if meta.prompt_mask is not None:
            seen |= meta.prompt_mask
        penalty = meta.repetition_penalty[:, None]
        # dividing positive and multiplying negative logits makes a seen token less likely either way
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if meta.frequency_penalty is not None or meta.presence_penalty is not None:
        counts = meta.output_counts                                  # [N, V]
        if meta.frequency_penalty is not None:
            logits = logits - meta.frequency_penalty[:, None] * counts
        if meta.presence_penalty is not None:
            logits = logits - meta.presence_penalty[:, None] * (counts > 0)
    return logits


def apply_filters(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The random rows' filters, in place where they can be: temperature, then top-k/top-p, then min-p."""
    if meta.temperature is not None:
        logits.div_(meta.temperature[:, None])
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.max_top_k)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int) -> torch.Tensor:
    """Mask to -inf what top-k and then top-p (on the renormalised sorted probs) leave out; vLLM semantics."""
    if top_p is None and top_k is None:
        return logits
    vocab_size = logits.shape[1]
    neg_inf = float("-inf")
    if top_p is None:
        # top-k alone needs only the largest max_top_k values per row, not a full sort
        top_values = logits.topk(max_top_k, dim=-1).values                         # [N, max_top_k]
        kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])      # [N, 1]
        kth = kth.masked_fill((top_k >= vocab_size)[:, None], neg_inf)              # disabled rows keep all
        return logits.masked_fill_(logits < kth, neg_inf)

    sorted_logits, sorted_ids = logits.sort(dim=-1)                                # ascending, [N, V]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k)[:, None])                # [N, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, neg_inf)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)                       # [N, V]
    # drop the low tail whose mass stays within 1 - top_p; the most likely token always survives
    drop = cum_probs <= (1.0 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, neg_inf)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's (done in log space)."""
    # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); min_p = 0 gives -inf and keeps everything
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]     # [N, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor,
                    num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled token's logprob followed by the top-`num_logprobs` ones, and the sampled token's rank."""
    sampled = sampled[:, None]                                                     # [N, 1]
    sampled_logprob = raw_logprobs.gather(1, sampled)                              # [N, 1]
    # rank counts ties against the sampled token, as vLLM does: 1 means nothing is more likely
    ranks = (raw_logprobs >= sampled_logprob).sum(dim=-1)                          # [N]
    if num_logprobs == 0:
        return sampled, sampled_logprob, ranks
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)               # [N, num_logprobs]
    return torch.cat([sampled, top_ids], dim=1), torch.cat([sampled_logprob, top_logprobs], dim=1), ranks


# splitmix64 constants, stored as the signed int64 values with the same bits
def _signed64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic, so clear the sign-filled bits)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 multiplication wraps like uint64, so the bits match the unsigned original."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def random_bits(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int, first_id: int = 0) -> torch.Tensor:
    """[N, V] int64 of 64 random bits per (seed, counter, token id), a pure function of those three numbers; with
    `first_id`, of the ids first_id .. first_id + V - 1 (a vocabulary shard's)."""
    # one splitmix64 stream per (seed, counter): hash the seed, step to the counter, hash again for the row key
    row_key = _mix64(_mix64(seeds + _GOLDEN) + (counters + 1) * _GOLDEN)             # [N]
    ids = torch.arange(first_id, first_id + vocab_size, dtype=torch.int64, device=seeds.device)   # [V]
    return _mix64(row_key[:, None] + ((ids + 1) * _GOLDEN)[None, :])                 # [N, V]


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int, first_id: int = 0) -> torch.Tensor:
    """[N, V] float32 standard Gumbel noise, -log(E) with E ~ Exp(1), from `random_bits` (of the ids from
    `first_id`)."""
    # top 23 bits plus a half step: uniform strictly inside (0, 1) and exact in float32, so no log(0)
    uniform = (_shift_right(random_bits(seeds, counters, vocab_size, first_id), 41).float() + 0.5) * (2.0 ** -23)
    return -torch.log(-torch.log(uniform))
