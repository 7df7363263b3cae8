"""The speculative-decoding benchmark on a tiny random model in bfloat16 (CPU): the peaked weights make greedy
decoding follow a fixed chain (checked inside `run`), and speculation with the replay proposer measures the mean
acceptance length asked for, with the plain run's tokens."""

import numpy as np
import pytest

from benches.spec_decode import ReplayProposer, run
from tests.helpers.model_harness import tiny_config


# llama's head is its own parameter (a permuted chain), qwen3's is tied to the embedding (each token repeats)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_replay_measures_the_asked_acceptance_length(tmp_path, family):
    tiny_config(family, num_hidden_layers=2).save_pretrained(tmp_path)
    results = run(str(tmp_path), [1, 3], 4, 2.5, prompt_len=12, output_len=40, async_spec=True, device="cpu",
                  dtype="bfloat16")
    assert [(r["batch"], r.get("scheduling")) for r in results] == [(1, None), (3, None), (1, "async"), (3, "async")]
    for r in results:
        assert r["greedy_tokens_match"] is True
        # the async path draws the accepted count per row and step (2 or 3 at even odds): a looser bound
        assert abs(r["mean_acceptance_length"] - 2.5) <= (0.1 if r.get("scheduling") is None else 0.35), r


def test_replay_proposer_corrupts_the_proposal_after_the_carried_count():
    prompt = (5, 6)
    proposer = ReplayProposer({prompt: [5, 6, 10, 11, 12, 13, 14, 15]}, k=4, mean_accepted=1.5, vocab=16,
                              key_len=2)
    # carry 1.5 -> 1 accepted, then 2.0 -> 2, then 1.5 -> 1: the proposal after them is the next token + 1
    assert proposer.propose(np.array([5, 6]), 4).tolist() == [10, 12, 12, 13]
    assert proposer.propose(np.array([5, 6, 10]), 4).tolist() == [11, 12, 14, 14]
    assert proposer.propose(np.array([5, 6, 10, 11]), 2).tolist() == [12, 14]
    with pytest.raises(ValueError, match="outside 0..k=4"):
        ReplayProposer({}, k=4, mean_accepted=4.5, vocab=16, key_len=2)
