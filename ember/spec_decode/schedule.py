"""What the scheduler asks before it gives a decoding request proposals: may it speculate, and how many tokens."""

from __future__ import annotations

import numpy as np

from ember.sampling_params import SamplingParams
from ember.spec_decode.proposer import Proposer


def propose_for(proposer: Proposer, prompt: list[int], output: list[int], params: SamplingParams, max_tokens: int,
                room: int) -> tuple[int, ...]:
    """Proposals for a request whose last token is on the host, at most `room` (the step's budget and the
    context left) and never past `max_tokens`. A request with penalties, or still under `min_tokens`, gets none:
    each proposed position would need its own penalty counts or block list, so it decodes one token at a time."""
    num_out = len(output)
    limit = proposal_limit(params, num_out, max_tokens, room)
    if limit <= 0:
        return ()
    tokens = np.fromiter((*prompt, *output), dtype=np.int64, count=len(prompt) + num_out)
    return tuple(proposer.propose(tokens, limit).tolist())


def proposal_limit(params: SamplingParams, num_out: int, max_tokens: int, room: int) -> int:
    """How many tokens a request may have proposed (0: none), `propose_for`'s rules."""
    if (num_out < params.min_tokens or params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0):
        return 0
    return min(room, max_tokens - num_out - 1)
