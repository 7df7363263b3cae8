"""benches/tp_sampling.py on the CPU: the shard-local design (C), the Sampler's first pass over each rank's columns
(`ember.kernels.sampling.sample_partials` with the shard's first id, interpreted) and its reduce over every rank's
partials, gives the whole-row sampler's tokens, ties across and within shards and a grammar's bitmask included; and
two gloo ranks running all three designs (every rank, rank 0 + broadcast, shard-local) agree with the whole-row
sampler on every rank."""

import pytest
import torch

from benches import tp_sampling as TS
from ember.kernels import sampling as SK
from ember.runner.sampler import Sampler

pytest.importorskip("triton")
CPU = torch.device("cpu")
VOCAB = 1000


def _ranks(rows: int, ranks: int, seed: int) -> tuple[torch.Tensor, list[TS.Inputs]]:
    """Every rank's inputs for one step and the whole [rows, VOCAB] logits they split."""
    inputs = [TS.Inputs(rows, VOCAB, r, ranks, CPU) for r in range(ranks)]
    logits = [i.fill(seed) for i in inputs][0]
    return logits, inputs


def _shard_local(inputs: list[TS.Inputs], first_id=None) -> torch.Tensor:
    """C's tokens with the ranks' all-gather done in place: every rank's partials side by side."""
    per_rank = [SK.sample_partials(i.shard, i.temperature, i.seeds, i.counters, i.greedy_mask, False, i.bitmask,
                                   i.mask_index, first_id=i.first_col if first_id is None else first_id)
                for i in inputs]
    return TS.best_over_ranks(torch.cat([p.view(p.shape[0], -1) for p in per_rank], dim=1), len(inputs))


def _whole_row(logits: torch.Tensor, inputs: list[TS.Inputs], use_triton: bool) -> torch.Tensor:
    return Sampler(use_triton=use_triton)(logits, inputs[0].metadata(VOCAB)).sampled_token_ids


@pytest.mark.parametrize("ranks", [2, 4])
def test_shard_local_tokens_equal_the_whole_row_samplers(ranks):
    logits, inputs = _ranks(16, ranks, seed=3)
    want = _whole_row(logits, inputs, use_triton=False)
    assert torch.equal(_whole_row(logits, inputs, use_triton=True), want)
    greedy = inputs[0].greedy_mask
    assert int(greedy.sum()) == 4
    assert torch.equal(want[greedy], logits.argmax(dim=1)[greedy])
    # the noise moved some sampled row off its argmax, or only argmax would be checked
    assert (want[~greedy] != logits.argmax(dim=1)[~greedy]).sum() >= 3
    assert torch.equal(_shard_local(inputs), want)
    # noise keyed by the shard's own column numbers instead of the global ids samples other tokens
    wrong = _shard_local(inputs, first_id=0)
    assert (wrong[~greedy] != want[~greedy]).any()


def test_greedy_ties_go_to_the_lowest_global_id():
    logits, inputs = _ranks(8, 2, seed=7)                # rows 3 and 7 are greedy; rank 1 holds ids 500..999
    logits[3] = -1.0
    logits[3, [10, 600]] = 5.0                           # across the shards: rank 0's id wins
    logits[7] = -1.0
    logits[7, [900, 600, 700]] = 5.0                     # within rank 1's shard: the lowest id
    for i in inputs:
        i.shard.copy_(logits[:, i.first_col:i.first_col + i.shard_cols])
    tokens = _shard_local(inputs)
    assert tokens[3].item() == 10 and tokens[7].item() == 600
    assert torch.equal(tokens, _whole_row(logits, inputs, use_triton=False))


def test_a_grammar_bitmask_is_read_by_global_id_on_each_shard():
    logits, inputs = _ranks(8, 2, seed=9)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[7, 520, 777, 901]] = True                   # ids on both shards, none among most rows' argmax
    words = torch.zeros(-(-VOCAB // 32) * 32, dtype=torch.int64)
    words[:VOCAB] = allowed.long()
    packed = (words.view(-1, 32) << torch.arange(32)).sum(dim=1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    for i in inputs:
        i.bitmask.copy_(packed[None])
        i.mask_index.copy_(torch.tensor([1, 0, 1, 1, 0, 1, 1, 1]))    # rows 1 and 4 unconstrained
    tokens = _shard_local(inputs)
    assert torch.equal(tokens, _whole_row(logits, inputs, use_triton=False))
    constrained = inputs[0].mask_index > 0
    assert allowed[tokens[constrained]].all()
    assert not allowed[tokens[~constrained]].all()       # the others were free to go elsewhere


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
    assert TS.bytes_received("C", 256, 128256, 4, splits=3) == 3 * 256 * 2 * 3 * 4


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--vocab", "1001"], "does not split evenly over 2 ranks"),
    (["--device", "cpu", "--ranks", "1"], "2 or more ranks"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        TS.main(argv)
    assert message.replace("\\", "") in capsys.readouterr().err
