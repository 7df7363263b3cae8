"""Greedy runs of one request compared alone and in a batch, where random weights give nearly flat logits."""

from __future__ import annotations

# a request's greedy run alone and in a batch (other graphs, other GEMM shapes, the same numbers rounded in another
# order) may part at a near tie, never elsewhere; a batch that reads or computes a row wrongly gives other tokens at
# once, far from a tie
NEAR_TIE = 0.05     # nats between the two candidates, in the run alone, where the two runs may part


def same_until_a_near_tie(alone, together) -> int:
    """The tokens two greedy runs of one request share (completion outputs with logprobs of at least the top two);
    where they part, the batch's token must be the run alone's second choice, within NEAR_TIE of its first."""
    for i, (a, b) in enumerate(zip(alone.token_ids, together.token_ids)):
        if a != b:
            top = alone.logprobs[i]
            assert b in top, f"token {i}: the batch's {b} is not among the run alone's top two {sorted(top)}"
            assert top[a].logprob - top[b].logprob <= NEAR_TIE, (i, top[a].logprob, top[b].logprob)
            return i
    return len(alone.token_ids)
