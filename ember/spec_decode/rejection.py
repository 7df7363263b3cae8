"""Rejection sampling of proposed tokens that keeps the target's distribution exactly.

For a proposed token x drawn from a draft distribution q, the target p accepts it with probability
min(1, p(x) / q(x)); on a rejection the token is drawn from the residual max(p - q, 0), renormalised. The emitted
token is then distributed as p, whatever q is. A deterministic proposer (n-gram) has q one-hot at x, and the rule
reduces to: accept x with probability p(x), else draw from p with x removed. When every proposal of a request is
accepted, a bonus token is drawn from the p of the position after them.

p is the distribution after the request's own processing (penalties, min_tokens, temperature, top-k, top-p,
min-p); a greedy request's p is one-hot at its argmax, so it accepts exactly the tokens its argmax chain would
emit, and the output is token for token the non-speculative one.

Randomness is the sampler's counter-based noise (`random_bits`): slot j of a request draws with the counter
`output_len + j`. The acceptance test reads the bits of the proposed token's own column and the residual draw
races Gumbel noise over every other column, so the two are independent, and a slot without a proposal samples
exactly the token the plain sampler would."""

from __future__ import annotations

import torch

from ember.runner.sampler import SamplingMetadata
from ember.runner.sampler.sampler import _shift_right, _token_mask, apply_filters, apply_penalties, random_bits


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits whose softmax is each row's p: a float32 copy with penalties, blocked ids, temperature, top-k,
    top-p and min-p applied (greedy rows: penalties and blocked ids only; their p is the argmax)."""
    out = apply_penalties(logits.to(torch.float32, copy=True), meta)
    if meta.blocked_token_ids is not None:
        out.masked_fill_(_token_mask(meta.blocked_token_ids, meta.vocab_size), float("-inf"))
    if meta.all_greedy:
        return out
    return apply_filters(out, meta)


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """Uniform floats strictly inside (0, 1) from 64-bit draws (the sampler's construction)."""
    return (_shift_right(bits, 41).float() + 0.5) * (2.0 ** -23)


def accept_or_resample(probs: torch.Tensor, draft: torch.Tensor, bits: torch.Tensor,
                       draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One slot per row: (accepted [M] bool, token [M] int64): the proposed token when accepted, else a draw from
    the residual. `probs` [M, V] is p; `draft` [M] the proposed ids (-1: none, the row just samples p);
    `draft_probs` [M, V] is q (None: one-hot at the proposal); `bits` [M, V] the row's random draws."""
    has = draft >= 0
    x = draft.clamp(min=0)[:, None]                                          # [M, 1]
    u = _uniform(bits.gather(1, x))[:, 0]                                    # [M]: the proposed column's draw
    p_x = probs.gather(1, x)[:, 0]
    if draft_probs is None:
        accept = has & (u < p_x)
        residual = probs.scatter(1, x, 0.0) if bool(has.any()) else probs    # p with x removed
        residual = torch.where(has[:, None], residual, probs)
    else:
        q_x = draft_probs.gather(1, x)[:, 0]
        accept = has & (u * q_x < p_x)                                       # u < min(1, p / q)
        residual = torch.where(has[:, None], (probs - draft_probs).clamp_(min=0.0), probs)
    # Gumbel-max over log(residual): the draw needs no normalisation; the proposed column's bits went to u above
    gumbel = -torch.log(-torch.log(_uniform(bits)))
    resampled = (torch.log(residual) + gumbel).argmax(dim=-1)
    return accept, torch.where(accept, draft, resampled)


def verify(logits: torch.Tensor, meta: SamplingMetadata, draft: torch.Tensor, num_slots: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a grid of R requests x `num_slots` slots, row-major in `logits` [R * S, V] and `meta` (expanded to
    slots, counters advanced per slot). `draft` [R, S]: slot j's proposed token, -1 for none (the slot after a
    request's last proposal samples its bonus token there; slots past it are padding). Returns (tokens [R, S],
    num_accepted [R]): request r emits tokens[r, :num_accepted[r] + 1]."""
    R, S = draft.shape
    flat = draft.reshape(-1)
    scores = processed_logits(logits, meta)
    greedy_tokens = None if meta.all_random else scores.argmax(dim=-1)
    if meta.all_greedy:
        accept, tokens = flat >= 0, greedy_tokens
        accept = accept & (greedy_tokens == flat)
    else:
        probs = torch.softmax(scores, dim=-1)
        bits = random_bits(meta.seeds, meta.output_lens, meta.vocab_size)
        accept, tokens = accept_or_resample(probs, flat, bits)
        if greedy_tokens is not None:
            greedy_accept = (flat >= 0) & (greedy_tokens == flat)
            accept = torch.where(meta.greedy_mask, greedy_accept, accept)
            tokens = torch.where(meta.greedy_mask, greedy_tokens, tokens)
    accept = accept.view(R, S)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)           # leading accepts
    return tokens.view(R, S), num_accepted
