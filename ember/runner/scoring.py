"""Teacher-forced scoring of one sequence in one prefill step: every position's logits (`all_logits`), or its prompt
logprobs computed a chunk of rows at a time (`prompt_logprobs`), so that the [num_tokens, V] logits of a long prompt
never exist at once: a chunk holds as many rows as the profile run sampled (`max_num_seqs`), within what start-up
measured."""

from __future__ import annotations

import torch

from ember.graphs.modes import BatchDescriptor, CUDAGraphMode
from ember.runner.step_input import StepInput


def step_hidden(runner, step: StepInput) -> torch.Tensor:
    """The final hidden states [num_tokens, H] of every scheduled token of `step`; its new requests leave the
    table afterwards (scoring is one step)."""
    try:
        num_reqs = step.num_reqs
        mode, desc = runner._dispatch(step)
        if runner.skip_prefill:   # every row is wanted: graphs of this model were captured with the tail's rows
            mode, desc = CUDAGraphMode.NONE, BatchDescriptor(step.total_num_tokens)
        num_reqs_padded = desc.padded_num_reqs(num_reqs)
        layout, seg, buf = runner._stage(step, num_reqs_padded)
        batch = runner.input_batch.prepare(runner.table, layout, seg, buf, desc.num_tokens, num_reqs_padded,
                                           *runner._graph_batch(desc, mode == CUDAGraphMode.FULL))
        hidden = runner._run(batch, mode, desc, skip=False)[0]
        return hidden[:batch.common.num_actual_tokens]
    finally:
        for new in step.new_requests:
            runner.table.remove(new.req_id)


def prompt_logprobs(runner, step: StepInput, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the one sequence `step` scores (its whole prompt, from position 0): per position after the first, the
    logprob of its token after the ones before it [n - 1], its rank [n - 1], and the `k` most likely tokens' ids and
    logprobs [n - 1, k]. The LM head runs a chunk of `max_num_seqs` rows at a time (every tensor-parallel rank the
    same chunks: its logits are gathered across ranks)."""
    (new,) = step.new_requests
    hidden = step_hidden(runner, step)[:-1]                          # row i predicts token i + 1
    targets = torch.tensor(new.prompt_token_ids[1:], dtype=torch.long, device=hidden.device)
    chunks = []
    for first in range(0, hidden.shape[0], runner.max_num_reqs):
        rows = slice(first, first + runner.max_num_reqs)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden[rows]).float(), dim=-1)   # [C, V]
        chosen = logprobs.gather(1, targets[rows, None])                                         # [C, 1]
        ranks = (logprobs > chosen).sum(-1) + 1
        top = logprobs.topk(k, dim=-1)
        chunks.append((chosen[:, 0], ranks, top.indices, top.values))
        del logprobs
    if not chunks:      # a one-token prompt has nothing to score
        empty = hidden.new_zeros(0)
        return empty.float(), empty.long(), empty.long().view(0, k), empty.float().view(0, k)
    return tuple(torch.cat(parts) for parts in zip(*chunks))
