"""The `Proposer` protocol: what the scheduler asks of anything that guesses a request's next tokens."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Proposer(Protocol):
    """Guesses up to `max_len` tokens that follow `token_ids` (a request's prompt and output so far, int64).

    The n-gram proposer answers from the tokens alone, on the host, before the step is launched. A proposer that
    runs a model answers for the step's requests at once instead: `DraftModelProposer.propose_batch` takes (request
    id, tokens, limit) triples and `drop(request_id)` when a request leaves, and the scheduler calls those when a
    proposer has them. EAGLE-style heads would also read the target's last hidden states, run on the device, and
    hand their tokens to the verify step without a host round trip."""

    def propose(self, token_ids: np.ndarray, max_len: int) -> np.ndarray:
        """At most `max_len` proposed token ids (int64, possibly none)."""
        ...
