"""The step's `SamplingMetadata`, read from the request table: host flags from its mirrors (which optional work the
sampler does), device tensors gathered from its rows (no per-step host lists)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ember.runner.request_table import (FREQUENCY, GREEDY, MIN_P, NUM_PROMPT, PRESENCE, REPETITION, SEED,
                                        TEMPERATURE, TOP_K, TOP_P, RequestTable)
from ember.runner.sampler import SamplingMetadata
from ember.runner.sampler.metadata import token_counts
from ember.runner.upload import PackedUpload


@dataclass(frozen=True)
class SamplingPlan:
    """What the host decided for one step's sampling, before the upload is flushed."""
    num_reqs: int
    all_greedy: bool
    all_random: bool
    use_temperature: bool
    max_top_k: int                        # 0: no top-k
    use_top_p: bool
    use_min_p: bool
    use_repetition: bool
    use_presence: bool
    use_frequency: bool
    max_prompt_len: int                   # the longest prompt and output, the columns penalties count
    max_output_len: int
    blocked: tuple[int, int] | None       # upload segment of [N, width] blocked ids (min_tokens), or None
    blocked_width: int
    max_num_logprobs: int | None
    num_masked: int = 0                   # rows sampling under a grammar bitmask (its first rows hold theirs)


def plan_sampling(table: RequestTable, rows: np.ndarray, seq_ends: np.ndarray, upload: PackedUpload,
                  num_masked: int = 0) -> SamplingPlan:
    """Host flags for the batch rows `rows` whose queries end at `seq_ends`; stages the min_tokens block list.
    `num_masked`: how many rows sample under a grammar bitmask.

    The same rows holding the same requests as the last step (the table's version unchanged) give the same plan,
    unless it has penalties (their widths follow the token counts), a min_tokens block list (which ends once
    enough tokens are out) or grammar rows (which sample only at the ends of their prompts); otherwise the last
    plan is reused and no numpy runs."""
    cached = table.plan_cache
    if not num_masked and cached is not None and cached[0] == table.version and np.array_equal(cached[1], rows):
        return cached[2]
    plan = _plan(table, rows, seq_ends, upload)
    if num_masked:
        plan = dataclasses.replace(plan, num_masked=num_masked)
    reusable = (plan.blocked is None and not (plan.use_repetition or plan.use_presence or plan.use_frequency)
                and not num_masked)
    table.plan_cache = (table.version, rows.copy(), plan) if reusable else None
    return plan


def _plan(table: RequestTable, rows: np.ndarray, seq_ends: np.ndarray, upload: PackedUpload) -> SamplingPlan:
    V = table.vocab_size
    pf, pi = table.params_f_np[rows], table.params_i_np[rows]        # [N, 7], [N, 3]
    greedy = pf[:, GREEDY] > 0.5
    all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
    top_k = pi[:, TOP_K]
    limited = top_k < V
    use_rep = bool((pf[:, REPETITION] != 1.0).any())
    use_pres = bool((pf[:, PRESENCE] != 0.0).any())
    use_freq = bool((pf[:, FREQUENCY] != 0.0).any())
    num_prompt = pi[:, NUM_PROMPT]
    # output tokens known before this step's own sample (a row part-way through its prompt has none)
    num_out = np.maximum(seq_ends - num_prompt, 0)
    blocked_seg, width = None, 0
    under = np.nonzero(num_out < table.min_tokens[rows])[0]
    if under.size:
        lists = [table.stop_ids[rows[i]] for i in under]
        width = max(len(x) for x in lists)
        if width:
            blocked = np.full((len(rows), width), V, dtype=np.int64)   # padded with the out-of-range id V
            for i, ids in zip(under, lists):
                blocked[i, :len(ids)] = ids
            blocked_seg = upload.put(blocked)
    logprobs = table.logprobs[rows]
    return SamplingPlan(
        num_reqs=len(rows), all_greedy=all_greedy, all_random=all_random,
        use_temperature=not all_greedy and bool((pf[:, TEMPERATURE] != 1.0).any()),
        max_top_k=int(top_k[limited].max()) if not all_greedy and limited.any() else 0,
        use_top_p=not all_greedy and bool((pf[:, TOP_P] < 1.0).any()),
        use_min_p=not all_greedy and bool((pf[:, MIN_P] > 0.0).any()),
        use_repetition=use_rep, use_presence=use_pres, use_frequency=use_freq,
        max_prompt_len=int(num_prompt.max()) if use_rep else 0,
        max_output_len=int(num_out.max()) if use_rep or use_pres or use_freq else 0,
        blocked=blocked_seg, blocked_width=width,
        max_num_logprobs=int(logprobs.max()) if (logprobs >= 0).any() else None)


def sampling_metadata(table: RequestTable, plan: SamplingPlan, idx: torch.Tensor, seq_lens: torch.Tensor,
                      buf: torch.Tensor, bitmask: torch.Tensor | None = None,
                      mask_index: torch.Tensor | None = None) -> SamplingMetadata:
    """Gather the batch rows `idx` [N] of the table on the device; `seq_lens` [N] are the step's (device);
    `bitmask` [R, W] and `mask_index` [N] (row + 1, 0 for none): the grammar rows' allowed tokens."""
    n, V = plan.num_reqs, table.vocab_size
    pf, pi = table.params_f[idx], table.params_i[idx]                  # [N, 7], [N, 3]
    num_prompt = pi[:, NUM_PROMPT]
    num_out = (seq_lens.to(torch.int64) - num_prompt).clamp_(min=0)   # [N]: the noise counter
    mixed = not plan.all_greedy and not plan.all_random

    def col(t, c):
        return t[:, c].contiguous()

    use_penalties = plan.use_repetition or plan.use_presence or plan.use_frequency
    blocked = None
    if plan.blocked is not None:
        blocked = PackedUpload.segment(buf, plan.blocked).view(n, plan.blocked_width)
    return SamplingMetadata(
        num_reqs=n, vocab_size=V, all_greedy=plan.all_greedy, all_random=plan.all_random,
        greedy_mask=pf[:, GREEDY] > 0.5 if mixed else None,
        temperature=col(pf, TEMPERATURE) if plan.use_temperature else None,
        top_k=col(pi, TOP_K) if plan.max_top_k else None,
        max_top_k=plan.max_top_k,
        top_p=col(pf, TOP_P) if plan.use_top_p else None,
        min_p=col(pf, MIN_P) if plan.use_min_p else None,
        seeds=col(pi, SEED), output_lens=num_out,
        prompt_mask=_count(table, idx, torch.zeros_like(num_prompt), num_prompt, plan.max_prompt_len, torch.bool)
        if plan.use_repetition else None,
        output_counts=_count(table, idx, num_prompt, num_out, plan.max_output_len, torch.int32)
        if use_penalties else None,
        repetition_penalty=col(pf, REPETITION) if plan.use_repetition else None,
        presence_penalty=col(pf, PRESENCE) if plan.use_presence else None,
        frequency_penalty=col(pf, FREQUENCY) if plan.use_frequency else None,
        blocked_token_ids=blocked, max_num_logprobs=plan.max_num_logprobs,
        bitmask=bitmask if plan.num_masked else None, mask_index=mask_index if plan.num_masked else None)


# ids gathered at once when counting a batch's tokens for penalties, [N, C] with C = this // N: a chunk's positions,
# ids and ones take 24 MiB, where gathering whole rows took 256 MiB a copy for 256 requests of 131,072 tokens
COUNT_CHUNK_ELEMENTS = 1 << 20


def _count(table: RequestTable, idx: torch.Tensor, start: torch.Tensor, count: torch.Tensor, width: int,
           dtype: torch.dtype) -> torch.Tensor:
    """[N, V] `dtype` (int32: occurrences, bool: presence) of each id among `count` token ids of the table rows
    `idx` [N] from `start`; `width` is the largest count. Gathered a chunk of columns at a time."""
    n, vocab_size = idx.shape[0], table.vocab_size
    out = torch.zeros(n, vocab_size + 1, dtype=dtype, device=idx.device)      # [N, V + 1]: the pad id's column last
    chunk = max(COUNT_CHUNK_ELEMENTS // max(n, 1), 1)
    for first in range(0, max(width, 1), chunk):
        cols = torch.arange(first, min(first + chunk, max(width, 1)), device=idx.device)   # [C]
        pos = (start[:, None] + cols[None, :]).clamp_(max=table.width - 1)              # [N, C]
        ids = table.token_ids[idx[:, None], pos].to(torch.int64)
        token_counts(ids.masked_fill_(cols[None, :] >= count[:, None], vocab_size), vocab_size, out=out)
    return out[:, :vocab_size]


def fits_graph_tail(plan: SamplingPlan) -> bool:
    """Whether a step's sampling needs nothing beyond what `graph_sampling_metadata` describes (temperature and
    seeds, greedy rows among random ones, grammar bitmasks), so the sampling recorded in a decode graph gives its
    tokens (grammar rows only if their bitmask was in place before the replay)."""
    return not (plan.max_top_k or plan.use_top_p or plan.use_min_p or plan.use_repetition or plan.use_presence
                or plan.use_frequency or plan.blocked is not None or plan.max_num_logprobs is not None)


def graph_sampling_metadata(table: RequestTable, idx: torch.Tensor, seq_lens: torch.Tensor, bitmask: torch.Tensor,
                            mask_index: torch.Tensor) -> SamplingMetadata:
    """Metadata for rows `idx` [N] that holds for every batch a decode graph may replay: greedy rows beside random
    ones, temperatures always applied (greedy rows hold 1.0), the grammar bitmask always read (rows whose
    `mask_index` is 0 skip it) and no host-side flags, so one recording serves any mix. It samples the tokens
    `sampling_metadata` does for any plan that `fits_graph_tail`."""
    pf, pi = table.params_f[idx], table.params_i[idx]                  # [N, 7], [N, 3]
    num_out = (seq_lens.to(torch.int64) - pi[:, NUM_PROMPT]).clamp_(min=0)
    return SamplingMetadata(
        num_reqs=idx.shape[0], vocab_size=table.vocab_size, all_greedy=False, all_random=False,
        greedy_mask=pf[:, GREEDY] > 0.5, temperature=pf[:, TEMPERATURE].contiguous(), top_k=None, max_top_k=0,
        top_p=None, min_p=None, seeds=pi[:, SEED].contiguous(), output_lens=num_out, prompt_mask=None,
        output_counts=None, repetition_penalty=None, presence_penalty=None, frequency_penalty=None,
        blocked_token_ids=None, max_num_logprobs=None, bitmask=bitmask, mask_index=mask_index)
