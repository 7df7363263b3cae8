"""The `Proposer` protocol: what the scheduler asks of anything that guesses a request's next tokens."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Proposer(Protocol):
    """Guesses up to `max_len` tokens that follow `token_ids` (a request's prompt and output so far, int64).

    The n-gram proposer answers from the tokens alone, on the host, before the step is launched. A draft model
    or EAGLE-style heads would answer for a whole batch from the target's last hidden states; they would take the
    batch (request ids and the step's hidden rows) instead, run on the device, and hand their tokens to the verify
    step without a host round trip; this protocol is the host-side special case the scheduler calls today."""

    def propose(self, token_ids: np.ndarray, max_len: int) -> np.ndarray:
        """At most `max_len` proposed token ids (int64, possibly none)."""
        ...
