"""The grammar bitmask on the device: bit t of row j (word t // 32, bit t % 32) allows token t. The torch path, the
Triton kernel that applies it in place and the one-pass sampling kernel that applies it as it reads (both run
interpreted here) agree, rows without a grammar are untouched, and the sampled token is always an allowed one."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.sampling import apply_token_bitmask_triton
from ember.runner.sampler import Sampler, SamplingMetadata
from ember.runner.sampler.sampler import apply_token_bitmask
from ember.sampling_params import SamplingParams

V = 1000          # not a multiple of 32: the last word is partly padding
WORDS = -(-V // 32)


def _bitmask(allowed: list[list[int]]) -> torch.Tensor:
    """[K, WORDS] int32 with the given token ids allowed per row."""
    bits = torch.zeros(len(allowed), WORDS * 32, dtype=torch.int64)
    for j, ids in enumerate(allowed):
        bits[j, ids] = 1
    words = (bits.view(len(allowed), WORDS, 32) << torch.arange(32)).sum(-1)      # [K, WORDS], 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _case(seed: int, num_rows: int = 6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, V, generator=g) * 3
    allowed = [torch.randperm(V, generator=g)[:int(n)].sort().values.tolist()
               for n in torch.randint(1, 40, (num_rows,), generator=g)]
    allowed[1] = [V - 1]                          # the very last id, in the padded word
    mask_index = torch.arange(1, num_rows + 1)
    mask_index[3] = 0                             # a row without a grammar
    return logits, allowed, _bitmask(allowed), mask_index


def test_bitmask_bits_are_the_allowed_ids():
    _, allowed, bitmask, _ = _case(0)
    for j, ids in enumerate(allowed):
        words = bitmask[j].to(torch.int64) & 0xFFFFFFFF
        found = [t for t in range(V) if (words[t // 32] >> (t % 32)) & 1]
        assert found == ids


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_and_triton_apply_the_same_bitmask(seed):
    logits, allowed, bitmask, mask_index = _case(seed)
    expected = logits.clone()
    for i in range(logits.shape[0]):
        if mask_index[i] > 0:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[allowed[int(mask_index[i]) - 1]] = True
            expected[i, ~keep] = float("-inf")
    torch_out = logits.clone()
    apply_token_bitmask(torch_out, bitmask, mask_index)
    triton_out = logits.clone()
    apply_token_bitmask_triton(triton_out, bitmask, mask_index)
    assert torch.equal(torch_out, expected) and torch.equal(triton_out, expected)
    assert torch.equal(torch_out[3], logits[3])                    # no grammar: untouched


def _meta(params, bitmask, mask_index, logprobs=False):
    n = len(params)
    if logprobs:
        params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, logprobs=3) for p in params]
    return SamplingMetadata.build(params, list(range(10, 10 + n)), [[]] * n, [[0]] * n, [()] * n, V, "cpu",
                                  bitmask=bitmask, mask_index=mask_index.tolist())


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("mix", ["greedy", "random", "mixed", "top_k", "logprobs"])
def test_the_sampled_token_is_always_allowed_and_both_paths_agree(use_triton, mix):
    logits, allowed, bitmask, mask_index = _case(2)
    n = logits.shape[0]
    params = {"greedy": [SamplingParams(temperature=0)] * n,
              "random": [SamplingParams(temperature=0.7)] * n,
              "mixed": [SamplingParams(temperature=0 if i % 2 else 1.3) for i in range(n)],
              "top_k": [SamplingParams(temperature=0.9, top_k=5)] * n,
              "logprobs": [SamplingParams(temperature=1.0)] * n}[mix]
    meta = _meta(params, bitmask, mask_index, logprobs=mix == "logprobs")
    before = logits.clone()
    out = Sampler(use_triton=use_triton)(logits, meta)
    assert torch.equal(logits, before)                             # the caller's logits stay untouched
    tokens = out.sampled_token_ids.tolist()
    for i, token in enumerate(tokens):
        if mask_index[i] > 0:
            assert token in allowed[int(mask_index[i]) - 1], (i, token)
    assert tokens[1] == V - 1                                      # the only token its grammar allows
    reference = Sampler(use_triton=False)(logits, meta).sampled_token_ids.tolist()
    assert tokens == reference
    if mix == "logprobs":      # logprobs follow the bitmask: the sampled token's are finite, others -inf
        ids, lps = out.logprob_token_ids, out.logprobs
        for i in range(n):
            if mask_index[i] > 0:
                assert torch.isfinite(lps[i, 0])
                for t, lp in zip(ids[i, 1:].tolist(), lps[i, 1:].tolist()):
                    assert (t in allowed[int(mask_index[i]) - 1]) == (lp != float("-inf"))


def test_rows_without_a_grammar_sample_as_if_there_were_no_bitmask():
    logits, _, bitmask, _ = _case(3)
    mask_index = torch.zeros(logits.shape[0], dtype=torch.int64)
    params = [SamplingParams(temperature=0.8)] * logits.shape[0]
    with_mask = Sampler(use_triton=True)(logits, _meta(params, bitmask, mask_index)).sampled_token_ids
    n = len(params)
    plain = SamplingMetadata.build(params, list(range(10, 10 + n)), [[]] * n, [[0]] * n, [()] * n, V, "cpu")
    assert torch.equal(with_mask, Sampler(use_triton=True)(logits, plain).sampled_token_ids)
