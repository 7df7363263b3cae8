"""Prompt logprobs of a long prompt are computed a chunk of rows at a time (`runner/scoring.py`): the prompt's
whole [n, V] logits never exist at once, and the figures equal those of the whole logits."""

from __future__ import annotations

import pytest
import torch

from ember import LLM
from tests.helpers.model_harness import random_hf_model, tiny_config
from tests.helpers.peak_memory import PeakMemory

VOCAB, PROMPT, ROWS, MAX_LEN = 8_000, 250, 8, 256


@pytest.mark.slow
def test_prompt_logprobs_of_a_long_prompt_hold_a_chunk_of_logits_not_the_whole(tmp_path):
    random_hf_model(tiny_config("llama", vocab_size=VOCAB, max_position_embeddings=MAX_LEN)).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_num_seqs=ROWS, max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN)
    tokens = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode(), PeakMemory() as peak:
        chosen, ranks, top_ids, top_logprobs = llm.engine.core.prompt_logprobs(tokens, 3)
    whole = PROMPT * VOCAB * 4                # one [n, V] float32 copy: 8 MB; the whole-logits path held two
    assert peak.peak < whole / 4, (peak.peak, whole)
    want = torch.log_softmax(llm.engine.score(tokens).float(), dim=-1)[:-1]
    targets = torch.tensor(tokens[1:])
    want_chosen = want.gather(1, targets[:, None])[:, 0]
    assert len(chosen) == len(ranks) == len(top_ids) == PROMPT - 1
    torch.testing.assert_close(torch.tensor(chosen), want_chosen, atol=1e-5, rtol=0)
    assert ranks == ((want > want_chosen[:, None]).sum(-1) + 1).tolist()
    assert top_ids == want.topk(3, dim=-1).indices.tolist()
