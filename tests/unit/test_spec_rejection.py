"""Rejection sampling keeps the target's distribution: over 100,000 draws the emitted tokens' frequencies are within
total-variation distance 0.01 of p, for a spread-out draft q, for a deterministic (one-hot) proposal, and through
`verify` with the request's temperature and top-k; greedy rows accept exactly their argmax chain. The n-gram
proposer's matches."""

import numpy as np
import torch

from ember.runner.sampler import SamplingMetadata
from ember.runner.sampler.sampler import random_bits
from ember.sampling_params import SamplingParams
from ember.spec_decode.ngram import NgramProposer
from ember.spec_decode.rejection import accept_or_resample, verify
from ember.speculative_config import SpeculativeConfig

N, V = 100_000, 6
P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=p.numel()).double() / tokens.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


def _bits(seed: int = 0) -> torch.Tensor:
    return random_bits(torch.arange(N, dtype=torch.int64) + seed * N, torch.zeros(N, dtype=torch.int64), V)


def test_spread_out_draft_keeps_the_target():
    q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.1, 0.05])
    draft = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))
    accept, tokens = accept_or_resample(P.expand(N, V), draft, _bits(), q.expand(N, V))
    assert _tv(tokens, P) < 0.01
    # acceptance probability sum_x q(x) min(1, p(x)/q(x)) = sum_x min(p, q)
    assert abs(float(accept.double().mean()) - float(torch.minimum(P, q).sum())) < 0.01
    assert _tv(draft, P) > 0.2           # the draft alone is far from p


def test_deterministic_proposal_keeps_the_target():
    for x in (0, 3, 5):
        draft = torch.full((N,), x, dtype=torch.int64)
        accept, tokens = accept_or_resample(P.expand(N, V), draft, _bits(x + 1))
        assert _tv(tokens, P) < 0.01
        assert abs(float(accept.double().mean()) - float(P[x])) < 0.01     # accepted with probability p(x)


def test_verify_with_temperature_and_top_k_keeps_the_processed_target():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 0.0])
    params = SamplingParams(temperature=0.7, top_k=4, seed=5)
    meta = SamplingMetadata.build([params] * N, list(range(N)), [[]] * N, [[0]] * N, [()] * N, V, "cpu")
    target = torch.softmax(torch.where(logits >= 0.2, logits / 0.7, float("-inf")), dim=-1)
    draft = torch.full((N, 1), 4, dtype=torch.int64)                         # outside the top 4: never accepted
    tokens, accepted = verify(logits.expand(N, V), meta, draft, 1)
    assert int(accepted.sum()) == 0 and _tv(tokens[:, 0], target) < 0.01
    draft = torch.full((N, 1), 1, dtype=torch.int64)
    tokens, accepted = verify(logits.expand(N, V), meta, draft, 1)
    assert abs(float(accepted.double().mean()) - float(target[1])) < 0.01
    assert _tv(tokens[:, 0], target) < 0.01


def test_greedy_rows_accept_their_argmax_chain():
    # three slots: the argmax is 2, then 4, then 1; proposals (2, 4) are both accepted, (2, 3) only the first
    logits = torch.full((2 * 3, V), 0.0)
    for r in range(2):
        logits[3 * r, 2] = logits[3 * r + 1, 4] = logits[3 * r + 2, 1] = 5.0
    greedy = SamplingParams(temperature=0.0)
    meta = SamplingMetadata.build([greedy] * 6, [0] * 6, [[]] * 6, [[0]] * 6, [()] * 6, V, "cpu")
    tokens, accepted = verify(logits, meta, torch.tensor([[2, 4, -1], [2, 3, -1]]), 3)
    assert accepted.tolist() == [2, 1]
    assert tokens[0].tolist() == [2, 4, 1] and tokens[1, :2].tolist() == [2, 4]


def test_ngram_proposals():
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7], dtype=np.int64)
    assert prop.propose(t, 3).tolist() == [8, 9, 1]              # the 3-gram (5, 6, 7) matched
    assert prop.propose(t, 2).tolist() == [8, 9]                 # never more than asked
    assert prop.propose(np.array([1, 2, 3, 4], dtype=np.int64), 3).tolist() == []     # no earlier match
    # a loop of period 2: the latest match followed by a whole proposal
    loop = np.array([9, 3, 4, 3, 4, 3, 4, 3], dtype=np.int64)
    assert prop.propose(loop, 3).tolist() == [4, 3, 4]
