"""The sampler's Triton kernels on a GPU at full vocabulary size (151936, bf16 logits): bits and noise bit-equal to
the torch path, one-pass sampling equal to argmax(logits / T + noise), Sampler(use_triton=True) equal to the torch
sampler, batch invariance, and no host sync."""

import pytest
import torch

from ember.sampling_params import SamplingParams
from ember.runner.sampler.sampler import Sampler, SamplingMetadata, gumbel_noise, random_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB_SIZE = 151936
NUM_ROWS = [1, 7, 256]


@pytest.fixture(scope="module")
def kernels():
    from ember.kernels import sampling as sampling_kernels
    return sampling_kernels


def _inputs(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n, VOCAB_SIZE, generator=g, device="cuda") * 3).to(torch.bfloat16)   # [N, V]
    seeds = torch.randint(0, 2**62, (n,), generator=g, device="cuda")
    counters = torch.randint(0, 5000, (n,), generator=g, device="cuda")
    temperature = torch.rand(n, generator=g, device="cuda") * 1.5 + 0.3
    return logits, seeds, counters, temperature


def _reference(logits, temperature, seeds, counters):
    x = logits.float()
    if temperature is not None:
        x = x / temperature[:, None]
    return (x + gumbel_noise(seeds, counters, logits.shape[1])).argmax(dim=-1)


@pytest.mark.parametrize("n", NUM_ROWS)
def test_bits_and_noise_equal_torch(kernels, n):
    _, seeds, counters, _ = _inputs(n)
    assert torch.equal(kernels.random_bits_triton(seeds, counters, VOCAB_SIZE),
                       random_bits(seeds, counters, VOCAB_SIZE))
    # libdevice's logf is CUDA's logf, which torch.log calls: the same float32 noise, bit for bit
    assert torch.equal(kernels.gumbel_noise_triton(seeds, counters, VOCAB_SIZE),
                       gumbel_noise(seeds, counters, VOCAB_SIZE))


@pytest.mark.parametrize("n", NUM_ROWS)
def test_sample_equals_reference(kernels, n):
    logits, seeds, counters, temperature = _inputs(n, seed=1)
    for temps in (temperature, None):
        got = kernels.sample_triton(logits, temps, seeds, counters, None, False)
        assert torch.equal(got, _reference(logits, temps, seeds, counters))
    greedy = torch.arange(n, device="cuda") % 3 == 0
    temps = torch.where(greedy, 1.0, temperature)
    got = kernels.sample_triton(logits, temps, seeds, counters, greedy, False)
    want = torch.where(greedy, logits.argmax(dim=-1), _reference(logits, temps, seeds, counters))
    assert torch.equal(got, want)
    assert torch.equal(kernels.sample_triton(logits, None, seeds, counters, None, True), logits.argmax(dim=-1))
    # a row stride wider than the vocabulary, float32 logits
    wide = torch.zeros(n, VOCAB_SIZE + 64, device="cuda")
    wide[:, 32:32 + VOCAB_SIZE] = logits.float()
    got = kernels.sample_triton(wide[:, 32:32 + VOCAB_SIZE], temperature, seeds, counters, None, False)
    assert torch.equal(got, _reference(logits, temperature, seeds, counters))


def test_ties_go_to_the_lowest_index(kernels):
    logits = torch.zeros(3, VOCAB_SIZE, device="cuda", dtype=torch.bfloat16)
    logits[0, [150000, 70001, 70000, 1024]] = 4.0
    logits[1, VOCAB_SIZE - 1] = 4.0
    logits[2] = float("-inf")
    seeds = counters = torch.zeros(3, dtype=torch.int64, device="cuda")
    got = kernels.sample_triton(logits, None, seeds, counters, None, True)
    assert got.tolist() == logits.argmax(dim=-1).tolist() == [1024, VOCAB_SIZE - 1, 0]


def test_no_host_sync(kernels):
    logits, seeds, counters, temperature = _inputs(7, seed=2)
    greedy = torch.tensor([True, False] * 3 + [False], device="cuda")
    kernels.sample_triton(logits, temperature, seeds, counters, greedy, False)    # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.sample_triton(logits, temperature, seeds, counters, greedy, False)
        kernels.gumbel_noise_triton(seeds, counters, VOCAB_SIZE)
    finally:
        torch.cuda.set_sync_debug_mode("default")


BATCHES = {
    "temperature_only": [SamplingParams(temperature=0.5 + 0.1 * (i % 10)) for i in range(256)],
    "greedy_only": [SamplingParams(temperature=0.0)] * 7,
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams()] * 85 + [
        SamplingParams()],
    "penalties": [SamplingParams(repetition_penalty=1.2, temperature=0.9), SamplingParams(presence_penalty=0.5),
                  SamplingParams(frequency_penalty=0.3, temperature=0.0), SamplingParams(min_tokens=3)] * 2,
    "top_k_top_p": [SamplingParams(top_k=50), SamplingParams(top_p=0.9, temperature=0.7), SamplingParams(),
                    SamplingParams(temperature=0.0)] * 2,
    "single": [SamplingParams(temperature=0.7)],
}


def _meta(params, seeds, outputs):
    n = len(params)
    return SamplingMetadata.build(params, seeds, outputs, [[5, 6]] * n, [(2,)] * n, VOCAB_SIZE,
                                  torch.device("cuda"))


@pytest.mark.parametrize("batch", list(BATCHES))
def test_sampler_triton_equals_torch(batch):
    params = BATCHES[batch]
    n = len(params)
    logits, _, _, _ = _inputs(n, seed=3)
    seeds = list(range(1000, 1000 + n))
    outputs = [[(13 * i + j) % VOCAB_SIZE for j in range(i % 9)] for i in range(n)]
    meta = _meta(params, seeds, outputs)
    assert Sampler()._kernels(logits) is not None     # CUDA logits pick the kernels by default
    got = Sampler()(logits, meta).sampled_token_ids
    want = Sampler(use_triton=False)(logits, meta).sampled_token_ids
    assert torch.equal(got, want)


def test_same_request_alone_and_in_a_batch():
    n = 256
    logits, _, _, _ = _inputs(n, seed=4)
    params = [SamplingParams(temperature=0.6 + (i % 5) * 0.2) for i in range(n)]
    seeds = [7 * i + 1 for i in range(n)]
    outputs = [[1] * (i % 11) for i in range(n)]
    sampler = Sampler()
    together = sampler(logits, _meta(params, seeds, outputs)).sampled_token_ids.tolist()
    for i in (0, 1, 100, 255):
        alone = sampler(logits[i:i + 1], _meta(params[i:i + 1], seeds[i:i + 1], outputs[i:i + 1]))
        assert alone.sampled_token_ids.item() == together[i]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    shuffled = sampler(logits[order], _meta([params[i] for i in order], [seeds[i] for i in order],
                                            [outputs[i] for i in order])).sampled_token_ids.tolist()
    assert [shuffled[order.index(i)] for i in range(n)] == together
