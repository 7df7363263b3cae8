"""The batched sampler: exact distributions of top-k/top-p/min-p, seeds, penalties, greedy, min_tokens, logprobs."""

from collections import Counter

import pytest
import torch

from ember.sampling_params import SamplingParams
from ember.runner.sampler.sampler import Sampler, SamplingMetadata, apply_penalties, gumbel_noise, random_bits

CPU = torch.device("cpu")
# fixed small logits in no particular order, so position in the vocabulary says nothing about probability
BASE_LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.0, -3.0, 1.5, 0.0, -0.5])


def make_meta(params, vocab_size, *, seeds=None, outputs=None, prompts=None, eos=None):
    n = len(params)
    return SamplingMetadata.build(
        params, list(range(n)) if seeds is None else seeds, outputs or [[] for _ in range(n)],
        prompts or [[] for _ in range(n)], eos or [() for _ in range(n)], vocab_size, CPU)


def sample(logits, params, **kw):
    return Sampler()(logits, make_meta(params, logits.shape[1], **kw))


def expected_probs(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0):
    """Reference in float64: temperature, top-k, top-p on the renormalised sorted probs, then min-p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    # a token is dropped when it and every less likely token together hold at most 1 - top_p of the mass
    tail = 0.0
    for idx in reversed(order.tolist()):
        tail += probs[idx].item()
        if tail <= 1.0 - top_p and idx != order[0].item():
            keep[idx] = False
    probs = torch.where(keep, probs, 0.0)
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def frequencies(tokens, vocab_size):
    return torch.bincount(tokens, minlength=vocab_size).double() / tokens.numel()


DISTRIBUTION_CASES = {
    "plain": dict(temperature=1.0),
    "temperature_0.6": dict(temperature=0.6),
    "temperature_2": dict(temperature=2.0),
    "top_k_3": dict(top_k=3),
    "top_p_0.85": dict(top_p=0.85),
    "min_p_0.1": dict(min_p=0.1),
    "all_four": dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.1),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_empirical_distribution_matches_exact(case):
    kwargs = DISTRIBUTION_CASES[case]
    n = 10_000    # std of a frequency is at most 0.005, so 0.02 is four sigma
    logits = BASE_LOGITS.expand(n, -1).contiguous()
    out = sample(logits, [SamplingParams(**kwargs)] * n)
    want = expected_probs(BASE_LOGITS, **kwargs)
    got = frequencies(out.sampled_token_ids, 8)
    assert (got - want).abs().max().item() < 0.02, (got, want)
    # tokens outside the top-k / top-p / min-p set are never drawn
    assert got[want == 0].sum().item() == 0.0
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_filters_remove_the_expected_number_of_tokens():
    # the cases above must actually cut something, otherwise "never sampled" checks nothing
    assert (expected_probs(BASE_LOGITS, top_k=3) > 0).sum().item() == 3
    assert (expected_probs(BASE_LOGITS, top_p=0.85) > 0).sum().item() == 4
    assert (expected_probs(BASE_LOGITS, min_p=0.1) > 0).sum().item() == 5
    assert (expected_probs(BASE_LOGITS, temperature=1.3, top_k=6, top_p=0.9, min_p=0.1) > 0).sum().item() == 5


def test_mixed_top_k_rows_and_greedy_rows_in_one_pass():
    # top-k only (partial top-k path) with some rows disabled, plus greedy rows in the same batch
    n = 9_000
    params = [SamplingParams(top_k=2), SamplingParams(top_k=-1), SamplingParams(temperature=0.0)] * (n // 3)
    out = sample(BASE_LOGITS.expand(n, -1).contiguous(), params).sampled_token_ids
    for start, kwargs in ((0, dict(top_k=2)), (1, dict())):
        got = frequencies(out[start::3], 8)
        assert (got - expected_probs(BASE_LOGITS, **kwargs)).abs().max().item() < 0.025
    assert torch.equal(out[2::3], torch.full((n // 3,), 1))   # argmax of BASE_LOGITS


def test_noise_over_output_positions_of_one_seed_matches_softmax():
    # one request over many steps: the counter alone must decorrelate the draws
    n = 10_000
    noise = gumbel_noise(torch.full((n,), 1234), torch.arange(n), 8)
    tokens = (BASE_LOGITS[None, :] + noise).argmax(dim=-1)
    assert (frequencies(tokens, 8) - torch.softmax(BASE_LOGITS.double(), -1)).abs().max().item() < 0.02


def test_random_bits_match_splitmix64_reference():
    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    golden = 0x9E3779B97F4A7C15
    seeds, counters = [0, 77, 2**63 - 1], [0, 3, 10**6]
    bits = random_bits(torch.tensor(seeds), torch.tensor(counters), 5)
    for row, (s, c) in enumerate(zip(seeds, counters)):
        key = mix((mix((s + golden) & mask) + (c + 1) * golden) & mask)
        for tok in range(5):
            assert bits[row, tok].item() & mask == mix((key + (tok + 1) * golden) & mask)


def _request_batch(generator, count, vocab_size):
    params = [SamplingParams(temperature=0.8, top_k=10), SamplingParams(top_p=0.7),
              SamplingParams(min_p=0.05, temperature=1.5), SamplingParams(),
              SamplingParams(top_k=5, top_p=0.9, repetition_penalty=1.2)]
    return [dict(params=params[i % len(params)], seed=int(torch.randint(0, 2**62, (1,), generator=generator)),
                 logits=torch.randn(vocab_size, generator=generator) * 2,
                 output=torch.randint(0, vocab_size, (i,), generator=generator).tolist(),
                 prompt=torch.randint(0, vocab_size, (3,), generator=generator).tolist()) for i in range(count)]


def _run(requests):
    logits = torch.stack([r["logits"] for r in requests])
    return sample(logits, [r["params"] for r in requests], seeds=[r["seed"] for r in requests],
                  outputs=[r["output"] for r in requests], prompts=[r["prompt"] for r in requests]).sampled_token_ids


def test_seeded_tokens_do_not_depend_on_batch_mates_or_position():
    g = torch.Generator().manual_seed(0)
    vocab_size = 64
    requests = _request_batch(g, 5, vocab_size)
    mates = _request_batch(g, 6, vocab_size)
    mates[0]["params"] = SamplingParams(temperature=0.0)
    mates[1]["params"] = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, top_p=0.5)
    alone = [_run([r]).item() for r in requests]
    together = _run(requests).tolist()
    shuffled_batch = [mates[0], requests[3], mates[1], requests[0], requests[4], mates[2], requests[2], requests[1]]
    shuffled = _run(shuffled_batch).tolist()
    assert together == alone
    assert [shuffled[i] for i in (3, 7, 6, 1, 4)] == alone
    # recomputing a step (e.g. after preemption) reproduces the token
    assert _run(requests).tolist() == together


def test_different_seeds_and_positions_give_different_draws():
    vocab_size = 1000
    logits = torch.zeros(200, vocab_size)
    by_seed = sample(logits, [SamplingParams()] * 200, seeds=list(range(200))).sampled_token_ids
    assert len(set(by_seed.tolist())) > 170    # 200 uniform draws from 1000 collide ~18 times on average
    # one seed, consecutive output positions
    outputs = [[0] * i for i in range(200)]
    by_step = sample(logits, [SamplingParams()] * 200, seeds=[7] * 200, outputs=outputs).sampled_token_ids
    assert len(set(by_step.tolist())) > 170
    # and same seed at the same position is the same draw
    same = sample(logits[:3], [SamplingParams()] * 3, seeds=[7] * 3, outputs=[[0] * 5] * 3).sampled_token_ids
    assert same.tolist() == [by_step[5].item()] * 3


def test_penalties_match_direct_computation():
    g = torch.Generator().manual_seed(1)
    vocab_size = 20
    logits = torch.randn(4, vocab_size, generator=g) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7, presence_penalty=0.5),
              SamplingParams(frequency_penalty=-0.3, presence_penalty=1.5), SamplingParams()]
    prompts = [[1, 2, 2, 3], [4, 5], [6, 7, 8], [9]]
    outputs = [[3, 10, 10], [5, 11, 11, 11], [12, 12, 6, 13], [14]]
    meta = make_meta(params, vocab_size, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone(), meta)

    want = logits.clone()
    for row, p in enumerate(params):
        for tok in set(prompts[row]) | set(outputs[row]):
            value = want[row, tok].item()
            want[row, tok] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for tok, count in Counter(outputs[row]).items():
            want[row, tok] -= p.frequency_penalty * count + p.presence_penalty
    assert torch.allclose(got, want, atol=1e-6)
    # 4 + 3 repetition-penalised entries in rows 0-1, 3 presence/frequency-penalised in row 2, none in row 3
    assert (got != logits).sum().item() == (want != logits).sum().item() == 10

    # greedy picks the argmax of the penalised logits
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                             presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty)
              for p in params]
    out = sample(logits, greedy, prompts=prompts, outputs=outputs).sampled_token_ids
    assert torch.equal(out, want.argmax(dim=-1))


def test_only_needed_tensors_are_built():
    meta = make_meta([SamplingParams(temperature=0.0)] * 2, 10, outputs=[[1], [2]])
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None and meta.top_p is None
    assert meta.output_counts is None and meta.prompt_mask is None and meta.max_num_logprobs is None
    meta = make_meta([SamplingParams(presence_penalty=0.5), SamplingParams(top_k=4, logprobs=2)], 10,
                     outputs=[[1, 1, 1], [2]], prompts=[[3], [4]])
    assert meta.prompt_mask is None and meta.repetition_penalty is None
    # how often each id was generated (the padding of the shorter row counts nowhere)
    assert meta.output_counts.tolist() == [[0, 3] + [0] * 8, [0, 0, 1] + [0] * 7]
    assert meta.top_k.tolist() == [10, 4] and meta.max_top_k == 4 and meta.max_num_logprobs == 2


def test_greedy_equals_argmax_and_leaves_logits_untouched():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 100, generator=g).to(torch.bfloat16)
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    assert torch.equal(logits, before)


def test_mixed_greedy_and_random_rows():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    mixed = sample(logits, params, seeds=[5, 6, 7, 8, 9, 10]).sampled_token_ids
    random_only = sample(logits[1::2], params[1::2], seeds=[6, 8, 10]).sampled_token_ids
    assert torch.equal(mixed[0::2], logits[0::2].argmax(dim=-1))
    assert torch.equal(mixed[1::2], random_only)


def test_min_tokens_blocks_eos_and_stop_ids():
    n, vocab_size = 500, 10
    logits = torch.zeros(n, vocab_size)
    logits[:, 3] = 8.0    # EOS dominates
    logits[:, 5] = 7.0    # a stop token
    params = [SamplingParams(min_tokens=2, stop_token_ids=[5])] * n
    blocked = sample(logits, params, seeds=list(range(n)), outputs=[[1]] * n, eos=[(3,)] * n).sampled_token_ids
    assert ((blocked == 3) | (blocked == 5)).sum().item() == 0
    free = sample(logits, params, seeds=list(range(n)), outputs=[[1, 1]] * n, eos=[(3,)] * n).sampled_token_ids
    assert (free == 3).float().mean().item() > 0.6
    greedy = [SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[5])]
    logits[0, 7] = 1.0
    assert sample(logits[:1], greedy, eos=[(3,)]).sampled_token_ids.item() == 7


def test_logprobs_come_from_raw_logits_with_ranks():
    g = torch.Generator().manual_seed(4)
    vocab_size = 50
    logits = torch.randn(4, vocab_size, generator=g) * 2
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=2.0),
              SamplingParams(temperature=1.5, logprobs=0),
              SamplingParams(top_k=10, logprobs=3, presence_penalty=1.0),
              SamplingParams(temperature=0.0)]
    outputs = [[int(logits[0].argmax())], [], [1, 2], []]
    out = sample(logits, params, outputs=outputs)
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0], atol=1e-6)
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 1:], top_values, atol=1e-6)
    want_ranks = (raw > raw.gather(1, sampled[:, None])).sum(dim=-1) + 1
    assert torch.equal(out.ranks, want_ranks)
    # the repetition penalty moved row 0 off its raw argmax, so its rank is 2 or worse
    assert out.ranks[0].item() >= 2 and out.ranks[3].item() == 1


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="seeds has 1 entries"):
        SamplingMetadata.build([SamplingParams()] * 2, [0], [[], []], [[], []], [(), ()], 10, CPU)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_meta([SamplingParams(min_tokens=1)], 10, eos=[(12,)])
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(torch.zeros(2, 11), make_meta([SamplingParams()] * 2, 10))
