"""benches/tp_sampling.py on the CPU: the shard-local design (C) gives the whole-row sampler's tokens, through its torch
path and its Triton kernel (interpreted), ties across and within shards included; and two gloo ranks running all
three designs (every rank, rank 0 + broadcast, shard-local) agree with the whole-row sampler on every rank."""

import pytest
import torch

from benches import tp_sampling as TS
from ember.runner.sampler import Sampler
from ember.runner.sampler.sampler import gumbel_noise

CPU = torch.device("cpu")
VOCAB = 1000


def _ranks(rows: int, ranks: int, seed: int) -> tuple[torch.Tensor, list[TS.Inputs]]:
    """Every rank's inputs for one step and the whole [rows, VOCAB] logits they split."""
    inputs = [TS.Inputs(rows, VOCAB, r, ranks, CPU) for r in range(ranks)]
    logits = [i.fill(seed) for i in inputs][0]
    return logits, inputs


def _shard_local(inputs: list[TS.Inputs], best=TS.shard_best_torch, first_col=None) -> torch.Tensor:
    """C's tokens with the ranks' all-gather done in place: every rank's (score, id) side by side."""
    per_rank = [best(i.shard, i.first_col if first_col is None else first_col, i.temperature, i.seeds, i.counters,
                     i.greedy_mask) for i in inputs]
    return TS.best_over_ranks(torch.cat(per_rank, dim=1), len(inputs))


def test_shard_noise_is_the_columns_of_the_samplers_noise():
    seeds = torch.tensor([0, 2**62 + 5, 77], dtype=torch.int64)
    counters = torch.tensor([0, 3, 4095], dtype=torch.int64)
    whole = gumbel_noise(seeds, counters, VOCAB)
    assert torch.equal(TS.shard_gumbel(seeds, counters, 300, 200), whole[:, 300:500])
    assert not torch.equal(TS.shard_gumbel(seeds, counters, 0, 200), whole[:, 300:500])


@pytest.mark.parametrize("ranks", [2, 4])
def test_shard_local_tokens_equal_the_whole_row_samplers(ranks):
    logits, inputs = _ranks(16, ranks, seed=3)
    want = Sampler(use_triton=False)(logits, inputs[0].metadata(VOCAB)).sampled_token_ids
    greedy = inputs[0].greedy_mask
    assert int(greedy.sum()) == 4
    assert torch.equal(want[greedy], logits.argmax(dim=1)[greedy])
    # the noise moved some sampled row off its argmax, or only argmax would be checked
    assert (want[~greedy] != logits.argmax(dim=1)[~greedy]).sum() >= 3
    assert torch.equal(_shard_local(inputs), want)
    # noise keyed by the shard's own column numbers instead of the global ids samples other tokens
    wrong = _shard_local(inputs, first_col=0)
    assert (wrong[~greedy] != want[~greedy]).any()


def test_triton_shard_kernel_interpreted_equals_torch_and_the_whole_row_kernel():
    pytest.importorskip("triton")
    logits, inputs = _ranks(8, 2, seed=5)
    per_rank_torch = [TS.shard_best_torch(i.shard, i.first_col, i.temperature, i.seeds, i.counters, i.greedy_mask)
                      for i in inputs]
    per_rank_kernel = [TS.shard_best_triton(i.shard, i.first_col, i.temperature, i.seeds, i.counters,
                                            i.greedy_mask) for i in inputs]
    for got, want in zip(per_rank_kernel, per_rank_torch):
        assert got.shape == (8, 2) and got.dtype == torch.float32
        assert torch.equal(got[:, 1], want[:, 1])                      # the same global ids
        assert (got[:, 0] - want[:, 0]).abs().max().item() <= 1e-5     # numpy's log under the interpreter
    want = Sampler(use_triton=True)(logits, inputs[0].metadata(VOCAB)).sampled_token_ids
    assert torch.equal(_shard_local(inputs, TS.shard_best_triton), want)


@pytest.mark.parametrize("best", [TS.shard_best_torch, TS.shard_best_triton], ids=["torch", "triton"])
def test_greedy_ties_go_to_the_lowest_global_id(best):
    if best is TS.shard_best_triton:
        pytest.importorskip("triton")
    logits, inputs = _ranks(8, 2, seed=7)                # rows 3 and 7 are greedy; rank 1 holds ids 500..999
    logits[3] = -1.0
    logits[3, [10, 600]] = 5.0                           # across the shards: rank 0's id wins
    logits[7] = -1.0
    logits[7, [900, 600, 700]] = 5.0                     # within rank 1's shard: the lowest id
    for i in inputs:
        i.shard.copy_(logits[:, i.first_col:i.first_col + i.shard_cols])
    tokens = _shard_local(inputs, best)
    assert tokens[3].item() == 10 and tokens[7].item() == 600
    want = Sampler(use_triton=False)(logits, inputs[0].metadata(VOCAB)).sampled_token_ids
    assert torch.equal(tokens, want)


def test_two_gloo_ranks_agree_on_every_design():
    results = TS.run_ranks(2, "cpu", [1, 8], VOCAB, steps=2, reps=2)
    assert results["errors"] == []
    # rows 1 and 8, three designs: 2 greedy rows a design, 7 sampled, checked on each rank
    assert results["greedy_rows"] == [6, 6] and results["sampled_rows"] == [21, 21]
    assert sorted(results["times"]) == sorted((rows, design, "eager") for rows in (1, 8) for design in "ABC")
    assert all(us > 0 for us in results["times"].values())


def test_bytes_received_per_rank():
    assert TS.bytes_received("A", 256, 128256, 2) == 256 * 64128 * 4           # 65.7 MB: the other rank's half
    assert TS.bytes_received("B", 256, 128256, 2) == 256 * 64128 * 4 + 256 * 8
    assert TS.bytes_received("C", 256, 128256, 4) == 3 * 256 * 8


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--vocab", "1001"], "does not split evenly over 2 ranks"),
    (["--device", "cpu", "--ranks", "1"], "2 or more ranks"),
    (["--device", "cpu", "--vocab", str(2**24 + 2)], "exact below 2\\*\\*24"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        TS.main(argv)
    assert message.replace("\\", "") in capsys.readouterr().err


def test_shard_kernels_compile_for_an_h100():
    pytest.importorskip("triton")
    from tests.helpers.sm90 import compile_for_sm90
    partial = compile_for_sm90(TS._shard_partial_kernel.fn,
                               {"logits_ptr": "*fp32", "temperature_ptr": "*fp32", "seed_ptr": "*i64",
                                "counter_ptr": "*i64", "greedy_ptr": "*u8", "partial_ptr": "*fp32"},
                               {"ACCURATE_LOG": True, "BLOCK": 1024}, num_warps=8).asm["ptx"]
    # the one-pass sampler's arithmetic: a correctly rounded division by T and libdevice's logf (torch.log's)
    assert "div.rn.f32" in partial and "__nv_logf" in partial
    reduce = compile_for_sm90(TS._shard_reduce_kernel.fn, {"partial_ptr": "*fp32", "out_ptr": "*fp32"},
                              {"BLOCK_SPLITS": 256}).asm["ptx"]
    assert reduce.count("st.global") == 2          # the score and the id of its row
