"""Shard-local sampling under tensor parallelism: each rank samples its own vocabulary range and the ranks reduce a
few partials a row, giving the whole-row sampler's tokens exactly.

In one process: every shard's partials (the torch path and the Triton kernels, interpreted), side by side, reduce to
the whole-row Sampler's tokens for greedy and seeded temperature rows and grammar bitmask rows; a last shard's
padding columns are never sampled however large their logits. End to end on two gloo ranks: greedy and seeded
temperature tokens equal one rank's over 32 tokens, with every step sampled shard-local; a batch with a top-p row
gathers the logits instead; `shard_local_sampling=False` gathers for every step and gives the same tokens."""

import argparse

import pytest
import torch

from ember import LLM, SamplingParams
from ember.args import add_engine_args, engine_kwargs
from ember.config import ParallelConfig
from ember.distributed.shard import ShardSpec, vocab_range
from ember.runner.sampler import Sampler, SamplingMetadata
from ember.runner.sampler.shard_local import shard_samplable, torch_partials, torch_reduce
from tests.helpers.model_harness import random_hf_model, tiny_config

VOCAB = 317          # two ranks hold 159 and 158 ids (one padding column), three ranks 106, 106 and 105
ROWS = 12


def _step(seed: int = 0):
    """Logits [ROWS, VOCAB] and their metadata: greedy rows (every fourth) among seeded temperature rows, three
    rows under grammar bitmasks."""
    torch.manual_seed(seed)
    params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 0.6 + 0.1 * i) for i in range(ROWS)]
    logits = torch.randn(ROWS, VOCAB) * 3                                                  # [N, V]
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, -(-VOCAB // 32)), dtype=torch.int32)   # ~half allowed
    mask_index = [0, 1, 0, 2, 3, 0, 0, 0, 0, 0, 0, 0]                                      # rows 1, 3 (greedy), 4
    top = int(logits[3].argmax())
    bitmask[1, top // 32] &= ~(1 << top % 32)                     # the greedy row's grammar forbids its argmax
    meta = SamplingMetadata.build(params, [7 * i + 1 for i in range(ROWS)], [[5] * i for i in range(ROWS)],
                                  [[0]] * ROWS, [()] * ROWS, VOCAB, "cpu", bitmask=bitmask, mask_index=mask_index)
    return logits, meta


def _shards(logits: torch.Tensor, ranks: int, padding_value: float = 1e4):
    """Each rank's (first id, ids held, [N, R] logits), the padding columns past the vocabulary set to
    `padding_value` (the LM head leaves zeros there: any value must stay unsampled)."""
    out = []
    for rank in range(ranks):
        first, held, rows = vocab_range(VOCAB, ShardSpec(rank, ranks))
        shard = torch.full((logits.shape[0], rows), padding_value)
        shard[:, :held] = logits[:, first:first + held]
        out.append((first, held, shard))
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_shards_partials_reduce_to_the_whole_row_samplers_tokens(ranks):
    logits, meta = _step()
    want = Sampler(use_triton=False)(logits, meta).sampled_token_ids
    greedy = meta.greedy_mask
    # the noise moved sampled rows off their argmax, and the bitmask moved a greedy row (3): both are exercised
    masked = logits.clone()
    masked[3] = masked[3].masked_fill(~_allowed(meta, meta.mask_index[3] - 1), float("-inf"))
    assert torch.equal(want[greedy], masked.argmax(dim=1)[greedy]) and want[3] != logits[3].argmax()
    assert (want[~greedy] != logits.argmax(dim=1)[~greedy]).sum() >= 4
    assert all(_allowed(meta, meta.mask_index[r] - 1)[want[r]] for r in (1, 3, 4))
    shards = _shards(logits, ranks)
    torch_tokens = torch_reduce(torch.cat([torch_partials(s[:, :held], meta, first) for first, held, s in shards], 2))
    assert torch.equal(torch_tokens, want)
    # keyed by each shard's own column numbers instead of the global ids, the noise samples other tokens
    wrong = torch_reduce(torch.cat([torch_partials(s[:, :held], meta, 0) for _, held, s in shards], 2))
    assert (wrong[~greedy] != want[~greedy]).any()


def test_the_kernels_partials_skip_a_shards_padding_and_reduce_to_the_same_tokens():
    pytest.importorskip("triton")
    from ember.kernels import sampling as SK
    logits, meta = _step(seed=1)
    want = Sampler(use_triton=False)(logits, meta).sampled_token_ids
    shards = _shards(logits, 2)
    assert shards[1][1] == shards[1][2].shape[1] - 1         # rank 1 holds one padding column, set to 1e4

    def partials(first, held, shard):
        return SK.sample_partials(shard, meta.temperature, meta.seeds, meta.output_lens, meta.greedy_mask, False,
                                  meta.bitmask, meta.mask_index, first_id=first, num_ids=held)

    parts = [partials(*s) for s in shards]
    assert parts[0].shape == parts[1].shape          # the splits follow the shard's width: the ranks gather alike
    assert torch.equal(SK.reduce_partials(torch.cat(parts, 2)), want)
    # without num_ids the padding column (id 317, past the vocabulary) wins every row
    unmasked = SK.sample_partials(shards[1][2], meta.temperature, meta.seeds, meta.output_lens, meta.greedy_mask,
                                  False, None, None, first_id=shards[1][0])
    assert torch.equal(SK.reduce_partials(torch.cat([parts[0], unmasked], 2)), torch.full((ROWS,), VOCAB))


@pytest.mark.parametrize("vocab, ranks", [(9, 4), (2500, 2)])
def test_shards_past_the_vocabulary_and_splits_of_padding_alone_are_never_sampled(vocab, ranks):
    # 9 ids on 4 ranks: ranks of 3 ids, the last holding none; 2500 ids on 2 ranks padded to 3000 columns each (as
    # a wider LM head would be): the second rank's splits are its columns 0-2047 and 2048-2999, the last padding alone
    pytest.importorskip("triton")
    from ember.kernels import sampling as SK
    torch.manual_seed(vocab)
    n = 4
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8) for i in range(n)]
    logits = torch.randn(n, vocab) * 3
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, -(-vocab // 32)), dtype=torch.int32)
    meta = SamplingMetadata.build(params, [i + 3 for i in range(n)], [[5] * i for i in range(n)], [[0]] * n,
                                  [()] * n, vocab, "cpu", bitmask=bitmask, mask_index=[0, 1, 2, 0])
    want = Sampler(use_triton=False)(logits, meta).sampled_token_ids
    width = 3000 if vocab == 2500 else -(-vocab // ranks)
    kernel_parts, torch_parts = [], []
    for rank in range(ranks):
        first = min(rank * -(-vocab // ranks), vocab)
        held = min(vocab - first, -(-vocab // ranks))
        shard = torch.full((n, width), 1e4)                     # padding larger than any logit
        shard[:, :held] = logits[:, first:first + held]
        kernel_parts.append(SK.sample_partials(shard, meta.temperature, meta.seeds, meta.output_lens,
                                               meta.greedy_mask, False, meta.bitmask, meta.mask_index,
                                               first_id=first, num_ids=held))
        torch_parts.append(torch_partials(shard[:, :held], meta, first))
    assert held == (0 if vocab == 9 else 1250) and kernel_parts[0].shape[2] == (1 if vocab == 9 else 2)
    got = SK.reduce_partials(torch.cat(kernel_parts, 2), ranks * SK.most_splits(width, logits.device))
    assert torch.equal(got, want) and torch.equal(torch_reduce(torch.cat(torch_parts, 2)), want)
    assert bool((want < vocab).all()) and len(set(want.tolist())) > 1


def test_what_needs_the_whole_row_is_not_shard_samplable():
    _, meta = _step()
    assert shard_samplable(meta)
    for params in (SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=5),
                   SamplingParams(temperature=0.8, min_p=0.1), SamplingParams(temperature=0.8, logprobs=2),
                   SamplingParams(temperature=0.0, repetition_penalty=1.2)):
        other = SamplingMetadata.build([params], [0], [[5]], [[0]], [()], VOCAB, "cpu")
        assert not shard_samplable(other), params


def test_the_switch_on_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["shard_local_sampling"] is True
    assert engine_kwargs(parser.parse_args(["--no-shard-local-sampling"]))["shard_local_sampling"] is False
    with pytest.raises(ValueError, match="shard_local_sampling 'no' must be True or False"):
        ParallelConfig(shard_local_sampling="no").validate("cpu")


def _allowed(meta: SamplingMetadata, row) -> torch.Tensor:
    """[V] bool: the tokens bitmask row `row` allows."""
    words = meta.bitmask[int(row)]
    return ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:VOCAB] == 1


# ---- two gloo ranks ------------------------------------------------------------------------------------------

PROMPTS = [[1, 5, 9, 33, 7], list(range(40, 66)), [3, 4, 5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SEEDED = [SamplingParams(temperature=t, seed=s, max_tokens=32, ignore_eos=True)
          for t, s in ((0.8, 11), (1.0, 12), (1.3, 13))]
TOP_P = [SamplingParams(temperature=0.9, seed=21, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.9, top_p=0.8, seed=22, max_tokens=8, ignore_eos=True)]
SETTINGS = dict(device="cpu", max_num_batched_tokens=16, block_size=8, num_kv_blocks=40, max_model_len=64,
                max_num_seqs=4)


def _run(path: str, tp: int, **kwargs) -> tuple[list, list[dict[str, int]]]:
    """Tokens of the greedy, the seeded and the top-p batches, and rank 0's count of each batch's steps by sampling
    path."""
    llm = LLM(path, tensor_parallel_size=tp, **SETTINGS, **kwargs)
    tokens, counts = [], []
    try:
        steps = llm.engine.runner.decode_tail.steps
        for prompts, params in ((PROMPTS, GREEDY), (PROMPTS, SEEDED), (PROMPTS[:2], TOP_P)):
            before = dict(steps)
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            counts.append({path: steps[path] - before[path] for path in steps})
    finally:
        llm.engine.runner.shutdown()
    return tokens, counts


def test_two_ranks_sample_shard_local_the_tokens_of_one_rank(tmp_path):
    random_hf_model(tiny_config("llama", vocab_size=VOCAB)).save_pretrained(tmp_path)
    one, one_counts = _run(str(tmp_path), 1)
    two, two_counts = _run(str(tmp_path), 2)
    assert all(len(t) == 32 for batch in one[:2] for t in batch)
    assert two[0] == one[0]                                        # greedy
    assert two[1] == one[1]                                        # seeded temperature
    assert len({tuple(t) for t in one[1]}) == 3 and one[1] != one[0]
    assert two[2] == one[2]                                        # a top-p row among them
    assert all(c["shard_local"] == 0 for c in one_counts)          # one rank has no shard-local path
    greedy_steps, seeded_steps, top_p_steps = two_counts
    assert greedy_steps["gathered"] == 0 and greedy_steps["shard_local"] >= 32
    assert seeded_steps["gathered"] == 0 and seeded_steps["shard_local"] >= 32
    # every step of the top-p batch holds the top-p row: the logits are gathered
    assert top_p_steps["shard_local"] == 0 and top_p_steps["gathered"] >= 8

    off, off_counts = _run(str(tmp_path), 2, shard_local_sampling=False)
    assert off == two
    assert off_counts == [{"shard_local": 0, "gathered": sum(c.values())} for c in two_counts]
