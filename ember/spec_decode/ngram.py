"""Prompt-lookup (n-gram) proposals: the request's last n tokens are looked up among its earlier tokens, and the
tokens that followed an earlier occurrence are proposed. Pure numpy on the host: no device work."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ember.speculative_config import SpeculativeConfig


class NgramProposer:
    """n runs from `prompt_lookup_max` down to `prompt_lookup_min`; the first n with a match wins (a longer match
    is the better guess), and among its matches the latest that is followed by a whole proposal (generation that
    repeats itself tends to repeat its latest loop), else the earliest (the longest continuation). `lookback` bounds the tokens searched, so a long context costs a bounded scan."""

    def __init__(self, config: SpeculativeConfig, lookback: int = 4096):
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self.lookback = lookback

    def propose(self, token_ids: np.ndarray, max_len: int) -> np.ndarray:
        limit = min(self.k, max_len)
        tokens = token_ids[-self.lookback:]
        L = tokens.shape[0]
        if limit <= 0 or L < self.n_min + 1:
            return _NONE
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            # windows starting at 0 .. L-n-1: each is followed by at least one token
            windows = sliding_window_view(tokens[:L - 1], n)              # [L - n, n]
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + limit <= L]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:start + limit].astype(np.int64, copy=False)
        return _NONE


_NONE = np.zeros(0, dtype=np.int64)
