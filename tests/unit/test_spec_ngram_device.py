"""The device n-gram proposer (torch ops, and the Triton kernel under the interpreter) against the host proposer on
random histories: the same proposals, token for token, -1 where the host proposes fewer than k."""

import numpy as np
import pytest
import torch

from ember.spec_decode.ngram import NgramProposer
from ember.spec_decode.ngram_device import propose_ngram
from ember.speculative_config import SpeculativeConfig


def _reference(history: np.ndarray, k: int, n_min: int, n_max: int, lookback: int) -> list[int]:
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=n_min, prompt_lookup_max=n_max)
    got = NgramProposer(config, lookback=lookback).propose(history, k).tolist()
    return got + [-1] * (k - len(got))


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("k, n_min, n_max, lookback", [(4, 1, 4, 4096), (3, 2, 3, 24), (5, 1, 2, 4096)])
def test_device_ngram_equals_host_proposer(use_triton, k, n_min, n_max, lookback):
    rng = np.random.default_rng(k * 100 + n_max)
    num_rows, width = 12, 97
    table = torch.from_numpy(rng.integers(0, 4, size=(num_rows, width))).to(torch.int32)
    # small vocabularies (repeats everywhere), one with a loop, short and full rows, one row with a single token
    table[3, :60] = torch.tensor([5, 6, 7, 8] * 15)
    table[5] = torch.from_numpy(rng.integers(0, 40, size=width))
    rows = torch.tensor([0, 3, 5, 7, 2, 9, 11, 1], dtype=torch.int64)
    counts = torch.tensor([30, 59, 96, 1, 2, 97 - 1, 64, 5], dtype=torch.int64)
    got = propose_ngram(table, rows, counts, k, n_min, n_max, lookback, use_triton=use_triton)
    want = [_reference(table[r, :c].numpy().astype(np.int64), k, n_min, n_max, lookback)
            for r, c in zip(rows.tolist(), counts.tolist())]
    assert got.tolist() == want
    assert sum(x >= 0 for row in want for x in row) > 10      # the histories do produce proposals


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_long_histories_span_several_of_the_kernels_blocks(use_triton):
    # histories of up to 700 tokens: the kernel scans its 128-window blocks in turn (latest and earliest matches
    # kept across blocks), with lookbacks shorter and longer than the history; a constant row matches everywhere
    rng = np.random.default_rng(7)
    table = torch.from_numpy(rng.integers(0, 3, size=(6, 700))).to(torch.int32)
    table[2] = torch.from_numpy(rng.integers(0, 50, size=700))
    table[4] = 7
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 0], dtype=torch.int64)
    counts = torch.tensor([700, 300, 699, 0, 650, 129, 257], dtype=torch.int64)
    for k, n_min, n_max, lookback in ((4, 1, 4, 4096), (3, 2, 3, 200), (2, 3, 5, 130)):
        got = propose_ngram(table, rows, counts, k, n_min, n_max, lookback, use_triton=use_triton)
        want = [_reference(table[r, :c].numpy().astype(np.int64), k, n_min, n_max, lookback)
                for r, c in zip(rows.tolist(), counts.tolist())]
        assert got.tolist() == want
        assert want[3] == [-1] * k and want[4] == [7] * k      # an empty history; a constant one
