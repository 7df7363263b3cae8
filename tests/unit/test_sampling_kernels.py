"""The sampler's Triton kernels on the CPU, interpreted: the hash bits and Gumbel noise against the torch reference,
one-pass sampling against argmax(logits / T + noise), ties and NaN like torch.argmax, and Sampler(use_triton=True)
giving the torch sampler's tokens.

CPU tensors run an interpreted copy of the kernels whatever TRITON_INTERPRET says at import time (see
ember/runner/sampling_kernels.py), so this module needs no environment set-up. The noise is compared with a tolerance
here because the interpreter's log is numpy's, not torch's: over all 2**23 possible inputs the two -log(-log(u))
differ by at most 2**-20, about one float32 ulp at the largest noise value (16.6). On a GPU they are bit-equal.
"""

import pytest
import torch

pytest.importorskip("triton")

from ember.kernels import sampling as SK   # noqa: E402
from ember.engine.request import SamplingParams   # noqa: E402
from ember.runner.sampler.sampler import Sampler, SamplingMetadata, gumbel_noise, random_bits   # noqa: E402

CPU = torch.device("cpu")
NOISE_ATOL = 2e-6
SEEDS = torch.tensor([0, 77, 2**63 - 1, 123456789123, 5], dtype=torch.int64)
COUNTERS = torch.tensor([0, 3, 10**6, 2**40, 7], dtype=torch.int64)
VOCAB_SIZES = [1000, 4099]   # one masked tile; several splits with a 3-column tail (4099 = 4 * 1024 + 3)


def _logits(n, vocab_size, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab_size, generator=g) * 3).to(dtype)


def _reference(logits, temperature, seeds, counters):
    """The torch path's draw for random rows: argmax(float32 logits / T + gumbel_noise)."""
    x = logits.float()
    if temperature is not None:
        x = x / temperature[:, None]
    return (x + gumbel_noise(seeds, counters, logits.shape[1])).argmax(dim=-1)


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_random_bits_equal_torch_exactly(vocab_size):
    got = SK.random_bits_triton(SEEDS, COUNTERS, vocab_size)
    assert got.dtype == torch.int64 and got.shape == (5, vocab_size)
    assert torch.equal(got, random_bits(SEEDS, COUNTERS, vocab_size))


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_gumbel_noise_matches_torch(vocab_size):
    got = SK.gumbel_noise_triton(SEEDS, COUNTERS, vocab_size)
    want = gumbel_noise(SEEDS, COUNTERS, vocab_size)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= NOISE_ATOL
    # most values are bit-equal; a wrong hash or transform would leave almost none equal
    assert (got == want).float().mean().item() > 0.5


def test_split_plan_spreads_one_row_and_covers_the_vocabulary():
    for rows, target in ((1, 528), (7, 528), (256, 528), (5, 8), (1, 8)):
        for vocab_size in (1000, 4099, 151936):
            cols, splits = SK.split_plan(rows, vocab_size, target)
            assert cols % SK.BLOCK_SIZE == 0 and (splits - 1) * cols < vocab_size <= splits * cols
    assert SK.split_plan(1, 151936, 528) == (1024, 149)    # one request still gets 149 programs (H100: 132 SMs)
    assert SK.split_plan(256, 151936, 528) == (51200, 3)
    assert SK.split_plan(5, 4099, 8)[1] == 2 and SK.split_plan(1, 4099, 8)[1] == 5


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_equals_argmax_of_logits_plus_noise(vocab_size, dtype):
    logits = _logits(5, vocab_size, dtype)
    temperature = torch.tensor([0.7, 1.0, 1.5, 0.3, 2.0])
    for temps in (temperature, None):
        got = SK.sample_triton(logits, temps, SEEDS, COUNTERS, None, False)
        want = _reference(logits, temps, SEEDS, COUNTERS)
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
        # the noise really moved the draw away from the argmax somewhere, or this checks only argmax
        assert not torch.equal(got, logits.float().argmax(dim=-1))


def test_greedy_rows_mixed_with_random_rows_and_all_greedy():
    logits = _logits(5, 4099, torch.bfloat16, seed=1)
    temperature = torch.tensor([1.0, 0.8, 1.0, 1.3, 1.0])   # greedy rows hold 1.0, as SamplingMetadata makes them
    greedy = torch.tensor([True, False, True, False, False])
    got = SK.sample_triton(logits, temperature, SEEDS, COUNTERS, greedy, False)
    want = torch.where(greedy, logits.float().argmax(dim=-1), _reference(logits, temperature, SEEDS, COUNTERS))
    assert torch.equal(got, want)
    assert not torch.equal(got[~greedy], logits.float().argmax(dim=-1)[~greedy])
    # all greedy: no noise, seeds and counters unused
    got = SK.sample_triton(logits, None, SEEDS, COUNTERS, None, True)
    assert torch.equal(got, logits.float().argmax(dim=-1))


def test_non_contiguous_rows_and_columns():
    wide = _logits(5, 4099 + 37, torch.bfloat16, seed=2)
    logits = wide[:, 20:20 + 4099]                                   # row stride 4136
    assert not logits.is_contiguous()
    got = SK.sample_triton(logits, None, SEEDS, COUNTERS, None, False)
    assert torch.equal(got, _reference(logits.contiguous(), None, SEEDS, COUNTERS))
    transposed = _logits(1000, 3, seed=3).t()                        # column stride 3: copied to contiguous
    got = SK.sample_triton(transposed, None, SEEDS[:3], COUNTERS[:3], None, True)
    assert torch.equal(got, transposed.argmax(dim=-1))


def test_ties_nan_and_all_minus_inf_follow_torch_argmax():
    vocab_size = 4099
    logits = torch.zeros(5, vocab_size)
    logits[0, [3000, 1500, 2000, 4098]] = 5.0    # ties across three splits: the lowest index wins
    logits[1, [4098, 4097]] = 1.0                # ties inside the 3-column tail
    logits[2] = float("-inf")                    # nothing allowed: torch says index 0
    logits[3, [2500, 700]] = float("nan")        # NaN counts as the largest value, first one wins
    logits[3, 5] = float("inf")
    logits[4, 1024] = float("inf")               # +inf at a split boundary
    got = SK.sample_triton(logits, None, SEEDS, COUNTERS, None, True)
    assert got.tolist() == logits.argmax(dim=-1).tolist() == [1500, 4097, 0, 700, 1024]
    # random rows where only one token is allowed always draw it
    only = torch.full((5, vocab_size), float("-inf"))
    only[torch.arange(5), torch.tensor([0, 1023, 1024, 4098, 17])] = 0.0
    assert SK.sample_triton(only, None, SEEDS, COUNTERS, None, False).tolist() == [0, 1023, 1024, 4098, 17]


# ---- Sampler(use_triton=True) against Sampler(use_triton=False) --------------------------------------------

BATCHES = {
    "temperature_only": [SamplingParams(temperature=t) for t in (0.5, 1.0, 1.7, 0.9, 1.2)],
    "plain": [SamplingParams()] * 4,
    "greedy_only": [SamplingParams(temperature=0.0)] * 5,
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.4)],
    "penalties_and_min_tokens": [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.8),
                                 SamplingParams(frequency_penalty=0.5, temperature=0.0),
                                 SamplingParams(min_tokens=5, stop_token_ids=[7]), SamplingParams(temperature=0.6)],
    "top_k_top_p": [SamplingParams(top_k=20), SamplingParams(top_p=0.8, temperature=0.7), SamplingParams(),
                    SamplingParams(top_k=50, top_p=0.9), SamplingParams(temperature=0.0)],
    "min_p_and_logprobs": [SamplingParams(min_p=0.05, logprobs=3), SamplingParams(temperature=1.3, logprobs=0),
                           SamplingParams(temperature=0.0, logprobs=2)],
}
ONE_PASS = {"temperature_only", "plain", "greedy_only", "mixed", "penalties_and_min_tokens"}


def _meta(params, vocab_size, seeds, outputs, device=CPU):
    n = len(params)
    return SamplingMetadata.build(params, seeds, outputs, [[1, 2, 3]] * n, [(11,)] * n, vocab_size, device)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls into the two kernel entry points the sampler uses."""
    calls = {"sample_triton": 0, "gumbel_noise_triton": 0}
    for name in calls:
        def counting(*args, _real=getattr(SK, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(SK, name, counting)
    return calls


@pytest.mark.parametrize("batch", list(BATCHES))
def test_sampler_triton_path_gives_the_torch_tokens(batch, kernel_calls):
    params = BATCHES[batch]
    n, vocab_size = len(params), 1000
    logits = _logits(n, vocab_size, torch.bfloat16, seed=4)
    before = logits.clone()
    seeds = [11 * i + 3 for i in range(n)]
    outputs = [[(7 * i + j) % vocab_size for j in range(i)] for i in range(n)]   # lengths 0..n-1: the counters
    meta = _meta(params, vocab_size, seeds, outputs)
    got = Sampler(use_triton=True)(logits, meta)
    want = Sampler(use_triton=False)(logits, meta)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(logits, before)
    one_pass = batch in ONE_PASS
    assert kernel_calls == {"sample_triton": int(one_pass), "gumbel_noise_triton": int(not one_pass)}
    if want.logprobs is not None:
        assert torch.equal(got.logprob_token_ids, want.logprob_token_ids) and torch.equal(got.ranks, want.ranks)
        assert torch.allclose(got.logprobs, want.logprobs, atol=1e-6)
    if batch == "penalties_and_min_tokens":
        assert got.sampled_token_ids[3].item() not in (7, 11)     # min_tokens blocks the stop and eos ids


def test_sampler_picks_torch_on_cpu_unless_told():
    logits = torch.zeros(2, 10)
    assert Sampler()._kernels(logits) is None and Sampler(use_triton=False)._kernels(logits) is None
    assert Sampler(use_triton=True)._kernels(logits) is SK


def test_same_request_alone_and_in_a_batch_gives_the_same_token():
    vocab_size = 4099
    g = torch.Generator().manual_seed(5)
    params = [SamplingParams(temperature=0.9), SamplingParams(), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0.0), SamplingParams(presence_penalty=0.4)]
    logits = torch.randn(len(params), vocab_size, generator=g).to(torch.bfloat16)
    seeds = [int(torch.randint(0, 2**62, (1,), generator=g)) for _ in params]
    outputs = [[i] * (3 * i) for i in range(len(params))]
    sampler = Sampler(use_triton=True)
    alone = [sampler(logits[i:i + 1], _meta(params[i:i + 1], vocab_size, seeds[i:i + 1], outputs[i:i + 1]))
             .sampled_token_ids.item() for i in range(len(params))]
    together = sampler(logits, _meta(params, vocab_size, seeds, outputs)).sampled_token_ids.tolist()
    order = [3, 0, 4, 2, 1]
    shuffled = sampler(logits[order], _meta([params[i] for i in order], vocab_size, [seeds[i] for i in order],
                                            [outputs[i] for i in order])).sampled_token_ids.tolist()
    assert together == alone
    assert [shuffled[order.index(i)] for i in range(len(params))] == alone
