"""Shard-local sampling under tensor parallelism: each rank samples its own vocabulary range of the logits, the
ranks all-gather a few (score, token id) partials a row, and every rank reduces them to the same tokens, bit for bit
those the whole-row `Sampler` draws from the gathered logits.

It is exact for what scores each token on its own: temperature, the counter-based Gumbel noise (keyed by the
token's global id), greedy rows and grammar bitmasks (a token's bit, by its global id). Top-k, top-p and min-p,
penalties, min_tokens and logprobs need the whole row (`runner.sampling_inputs.fits_graph_tail` says which steps
need none of them); the caller takes the gathered path for those.

On CUDA the partials come from the Sampler's own Triton kernels (`ember.kernels.sampling.sample_partials` with the
shard's first id, then `reduce_partials`); on the CPU from the same torch ops as the Sampler's torch path, on the
shard's columns, so the tokens there equal that path's too.
"""

from __future__ import annotations

import torch

from ember.distributed.ops import all_gather
from ember.distributed.parallel_state import TP_GROUP
from ember.runner.sampler.metadata import SamplingMetadata
from ember.runner.sampler.sampler import Sampler, gumbel_noise

__all__ = ["ShardLocalSampler", "shard_sampler_for", "shard_samplable", "torch_partials", "torch_reduce"]

_NO_ID = torch.iinfo(torch.int32).max


class ShardLocalSampler:
    """`sampler(local_logits, meta)` -> [N] int64 tokens from this rank's [N, R] logits of the token ids
    first_id .. first_id + R - 1, of which the first `num_ids` are tokens (the rest, a last shard's padding past
    the vocabulary, are never sampled); the same tokens on every rank of `group`."""

    def __init__(self, first_id: int, num_ids: int, vocab_size: int, group: str, ranks: int,
                 use_triton: bool | None = None):
        self.first_id, self.num_ids, self.vocab_size = first_id, num_ids, vocab_size
        self.group, self.ranks = group, ranks
        self._choice = Sampler(use_triton)       # its rule for Triton or torch, nothing else

    def __call__(self, local_logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.vocab_size != self.vocab_size or local_logits.dim() != 2 or local_logits.shape[0] != meta.num_reqs:
            raise ValueError(f"logits of shape {tuple(local_logits.shape)} do not match the sampling metadata "
                             f"[num_reqs={meta.num_reqs}, vocab_size={meta.vocab_size}] of a {self.vocab_size}-token "
                             f"vocabulary")
        if not shard_samplable(meta):
            raise ValueError("shard-local sampling covers temperature, greedy rows and grammar bitmasks only; this "
                             "step's metadata asks for top-k/top-p/min-p, penalties, min_tokens or logprobs, which "
                             "need the gathered logits")
        kernels = self._choice._kernels(local_logits)
        num_rows = local_logits.shape[0]
        if kernels is None:
            partial = torch_partials(local_logits[:, :self.num_ids], meta, self.first_id)          # [N, 2, 1]
        else:
            partial = kernels.sample_partials(local_logits, meta.temperature, meta.seeds, meta.output_lens,
                                              meta.greedy_mask, meta.all_greedy, meta.bitmask, meta.mask_index,
                                              first_id=self.first_id, num_ids=self.num_ids)   # [N, 2, S]
        splits = partial.shape[2]
        gathered = all_gather(partial.view(num_rows, 2 * splits), self.group)          # [N, ranks * 2 * S]
        every = gathered.view(num_rows, self.ranks, 2, splits).transpose(1, 2).reshape(num_rows, 2, -1)
        if kernels is None:
            return torch_reduce(every)
        # the reduce's tile covers a one-row batch's splits, the most any batch has: one compiled kernel for all
        return kernels.reduce_partials(every, self.ranks * kernels.most_splits(local_logits.shape[1],
                                                                                local_logits.device))


def shard_samplable(meta: SamplingMetadata) -> bool:
    """Whether `meta` asks only for what shard-local sampling gives exactly."""
    return (meta.top_k is None and meta.top_p is None and meta.min_p is None and not meta.has_penalties
            and meta.blocked_token_ids is None and meta.max_num_logprobs is None)


def torch_partials(logits: torch.Tensor, meta: SamplingMetadata, first_id: int) -> torch.Tensor:
    """[N, 2, 1] float32: per row the best (score, token id as int32 bits) of `logits` [N, C], the columns of ids
    first_id .. first_id + C - 1, scored by the Sampler's torch path's own steps (bitmask, then for random rows
    logits / T + noise), so the best over every shard is the torch path's token."""
    num_rows, width = logits.shape
    partial = torch.empty(num_rows, 2, 1, dtype=torch.float32, device=logits.device)
    if width == 0:      # a shard wholly past the vocabulary: nothing to offer
        partial[:, 0] = float("-inf")
        partial[:, 1] = torch.tensor(_NO_ID, dtype=torch.int32).view(torch.float32)
        return partial
    scores = logits.to(torch.float32, copy=True)                                     # [N, C]
    if meta.bitmask is not None:
        _apply_shard_bitmask(scores, meta.bitmask, meta.mask_index, first_id)
    best = None if meta.all_random else scores.argmax(dim=-1)                        # [N] greedy rows' columns
    if not meta.all_greedy:
        greedy_scores = None if best is None else scores.gather(1, best[:, None])[:, 0]
        if meta.temperature is not None:
            scores.div_(meta.temperature[:, None])
        scores.add_(gumbel_noise(meta.seeds, meta.output_lens, width, first_id))
        sampled = scores.argmax(dim=-1)                                              # [N]
        sampled_scores = scores.gather(1, sampled[:, None])[:, 0]
        if best is None:
            best, value = sampled, sampled_scores
        else:
            best = torch.where(meta.greedy_mask, best, sampled)
            value = torch.where(meta.greedy_mask, greedy_scores, sampled_scores)
    else:
        value = scores.gather(1, best[:, None])[:, 0]
    partial[:, 0, 0] = value
    partial[:, 1, 0] = (best + first_id).to(torch.int32).view(torch.float32)
    return partial


def torch_reduce(partial: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's best token over partials [N, 2, P] (any order), as torch.argmax picks over the whole
    row: the highest score (NaN above everything), ties to the lowest id."""
    scores, ids = partial[:, 0], partial[:, 1].contiguous().view(torch.int32)       # [N, P]
    nan = scores.isnan()
    top = torch.where(nan, float("-inf"), scores).amax(dim=1, keepdim=True)
    winner = torch.where(nan.any(dim=1, keepdim=True), nan, scores == top)
    return torch.where(winner, ids, _NO_ID).amin(dim=1).to(torch.int64)


def _apply_shard_bitmask(scores: torch.Tensor, bitmask: torch.Tensor, mask_index: torch.Tensor, first_id: int) -> None:
    """In place: -inf where a row's grammar forbids token first_id + c in column c (bit t % 32 of word t // 32 of
    its bitmask row, as `apply_token_bitmask` reads the whole row); rows with mask_index 0 keep every token."""
    ids = torch.arange(first_id, first_id + scores.shape[1], device=scores.device)             # [C]
    words = bitmask[(mask_index - 1).clamp(min=0)][:, ids // 32]                                # [N, C]
    forbidden = (((words >> (ids % 32).to(torch.int32)) & 1) == 0) & (mask_index > 0)[:, None]
    scores.masked_fill_(forbidden, float("-inf"))


def shard_sampler_for(model, vocab_size: int, tp_size: int, enabled: bool) -> ShardLocalSampler | None:
    """This rank's shard-local sampler under tensor parallelism, over its LM head's vocabulary range; None on one
    rank or when `enabled` is False (every step then gathers the logits)."""
    if tp_size == 1 or not enabled:
        return None
    if not callable(getattr(model, "compute_shard_logits", None)):
        raise ValueError(f"{type(model).__name__} gives no shard of its logits (compute_shard_logits), so it cannot "
                         f"sample shard-local; start it with shard_local_sampling=False")
    first_id, num_ids = model.lm_head.vocab_shard
    return ShardLocalSampler(first_id, num_ids, vocab_size, TP_GROUP, tp_size)
