"""`SamplingParams(prompt_logprobs=K)`: the log-probability of every prompt token given the ones before it, with
the K most likely tokens at each position, as vLLM returns them (the first position has none).

They come from one teacher-forced pass of the prompt through the paged cache (`Engine.score`) before the request
is queued, so the sampling path stays as it is; the request's own prefill then runs as usual.
"""

from __future__ import annotations

import torch

from ember.engine.request import Logprob


def prompt_logprobs(engine, token_ids: list[int], k: int, tokenizer=None) -> list[dict[int, Logprob] | None]:
    """[None, {token: Logprob, ...}, ...]: one entry per prompt token; each holds the token itself (with its rank)
    and the `k` most likely tokens at that position."""
    logits = engine.score(list(token_ids))                           # [n, V]
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:-1]        # row i predicts token i + 1
    targets = torch.tensor(token_ids[1:], dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])                    # [n - 1, 1]
    ranks = (logprobs > chosen).sum(-1) + 1                          # [n - 1]
    top = logprobs.topk(k, dim=-1) if k else None
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    top_ids = top.indices.tolist() if top is not None else [[]] * len(chosen)
    top_lps = top.values.tolist() if top is not None else [[]] * len(chosen)
    entries: list[dict[int, Logprob] | None] = [None]
    for i, token in enumerate(token_ids[1:]):
        entry = {token: Logprob(chosen[i], ranks[i])}
        for rank, (t, lp) in enumerate(zip(top_ids[i], top_lps[i]), start=1):
            entry.setdefault(t, Logprob(lp, rank))
        if tokenizer is not None:
            for t, logprob in entry.items():
                logprob.decoded_token = tokenizer.decode([t])
        entries.append(entry)
    return entries
