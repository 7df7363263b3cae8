"""The end of a uniform-decode step, recorded in its FULL CUDA graph: each row's logits, the LM head, sampling,
and the write of the sampled tokens into the request table. A replay then leaves only the copy of the tokens to
the host, instead of a dozen launches and their Python.

What the graph records must hold for any batch it replays, so the sampling is the general form
(`graph_sampling_metadata`: temperature per row, greedy rows by mask, the grammar bitmask read from its persistent
buffer for rows that have one). A step whose plan needs more (top-k/top-p, penalties, min_tokens, logprobs) samples
again after the replay with the full sampler, which overwrites the tokens the graph wrote; the graph's tokens are
then unused.

Under tensor parallelism the tail is one of two variants, chosen at start-up alike on every rank: shard-local
(`ember.runner.sampler.shard_local`: each rank samples its own vocabulary range and the ranks all-gather a few
partials a row; exact for everything the general form holds) or, with `shard_local_sampling=False`, the LM head's
all-gather of the [N, V] logits and the whole-row sampler. Steps outside the graphs take the shard-local path too
when their plan allows it (`sample`), and the gathered one otherwise.

A decode step with grammar rows runs split (`SplitDecode`): the forward alone, replayed as soon as its inputs are
on the device, then the tail, replayed once the engine has put the bitmask, which needs the token of the step
before. Batches without grammar rows keep the one graph of both. Under tensor parallelism the split's tail begins
by broadcasting rank 0's bitmask rows (`GrammarMask.share`), inside its graph on every rank: the bytes go device to
device, and the one graph of a batch without grammar rows holds no such collective."""

from __future__ import annotations

import torch

from ember.attention_backends.op import ForwardContext, forward_context, get_forward_context
from ember.graphs.cuda_graph import CUDAGraphManager, CUDAGraphWrapper
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode
from ember.runner.input_batch import InputBatch
from ember.runner.request_table import RequestTable
from ember.runner.sampler import Sampler, SamplerOutput, SamplingMetadata
from ember.runner.sampler.shard_local import ShardLocalSampler
from ember.runner.sampling_inputs import graph_sampling_metadata


class DecodeTail:
    """`tail(hidden, num_rows)` -> sampled tokens [num_rows] of the step whose inputs sit in `input_batch`;
    `rows_are_logits`: the forward returns only the logits tokens' rows (a prefill-skipping model), in order;
    `shard_sampler`: sample shard-local (tensor parallel), else from the gathered logits."""

    def __init__(self, model: torch.nn.Module, sampler: Sampler, table: RequestTable, input_batch: InputBatch,
                 bitmask: torch.Tensor, rows_are_logits: bool = False,
                 shard_sampler: ShardLocalSampler | None = None, share=None):
        self.model, self.sampler, self.table, self.input_batch = model, sampler, table, input_batch
        self.share = share                # `GrammarMask.share` where this tail broadcasts the bitmask first
        self.bitmask = bitmask            # the grammar bitmask buffer (`GrammarMask.bitmask`), read in place
        self.rows_are_logits = rows_are_logits
        self.shard_sampler = shard_sampler
        self.steps = {"shard_local": 0, "gathered": 0}      # which path sampled each step (`count`)

    def __call__(self, hidden: torch.Tensor, num_rows: int) -> torch.Tensor:
        ib = self.input_batch
        if self.share is not None:
            self.share(num_rows)
        idx, sample_index = ib.row_info[0, :num_rows], ib.row_info[3, :num_rows]
        rows = hidden[:num_rows] if self.rows_are_logits else hidden[ib.logits_indices[:num_rows]]
        meta = graph_sampling_metadata(self.table, idx, ib.seq_lens[:num_rows], self.bitmask,
                                       ib.row_info[4, :num_rows])
        tokens = self.sample(rows, meta, shard_local=True).sampled_token_ids             # [R]
        self.table.write_sampled(sample_index, tokens)
        return tokens

    def sample(self, rows: torch.Tensor, meta: SamplingMetadata, shard_local: bool) -> SamplerOutput:
        """The tokens of hidden `rows` [R, H]: shard-local where this tail has a shard sampler and `shard_local`
        (the step's plan needs no whole row), else the whole-row sampler over the gathered logits."""
        if shard_local and self.shard_sampler is not None:
            tokens = self.shard_sampler(self.model.compute_shard_logits(rows), meta)     # [R]
            return SamplerOutput(tokens, None, None, None)
        return self.sampler(self.model.compute_logits(rows), meta)

    def count(self, shard_local: bool) -> None:
        """Record that a step's tokens came from the shard-local path (when this tail has it and the step's plan
        allowed it) or the gathered one."""
        self.steps["shard_local" if shard_local and self.shard_sampler is not None else "gathered"] += 1


def with_decode_tail(forward, tail: DecodeTail):
    """`forward` followed, for uniform-decode batches padded to a FULL-graph bucket, by the decode tail; the result
    returns (hidden, sampled tokens or None). A FULL graph of such a bucket records both."""

    def forward_and_sample(*args):
        hidden = forward(*args)
        desc = get_forward_context().batch_descriptor
        if desc is not None and desc.uniform_decode and desc.num_reqs is not None:
            return hidden, tail(hidden, desc.num_reqs)
        return hidden, None

    return forward_and_sample


class SplitDecode:
    """A decode step in two launches: `forward` (the forward alone; it ends by copying each row's last hidden state
    into `rows`, a buffer allocated once) and `sample(desc, mode, num_rows)` (the decode tail over `rows`, after
    `share(num_rows)` where one is given: the bitmask's broadcast under tensor parallelism). Under
    FULL graphs each is a graph of its own per descriptor, captured on its first use (lazy capture: its second), in
    the shared pool: neither reads the other's pool memory, only the persistent buffers."""

    def __init__(self, forward, tail: DecodeTail, graphs: CUDAGraphManager | None, max_num_reqs: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, rows_are_logits: bool = False,
                 share=None):
        self._forward, self.input_batch, self.rows_are_logits = forward, tail.input_batch, rows_are_logits
        self.rows = torch.zeros(max_num_reqs, hidden_size, dtype=dtype, device=device)      # [R, H]
        self.tail = DecodeTail(tail.model, tail.sampler, tail.table, tail.input_batch, tail.bitmask,
                               rows_are_logits=True, shard_sampler=tail.shard_sampler, share=share)
        self.num_rows = 0          # the step's rows (under a FULL graph, its descriptor's padded count)
        self.forward = self._forward_rows
        self.run_tail = self.tail          # the tail, or its graph wrapper
        if graphs is not None:
            self.forward = CUDAGraphWrapper(self._forward_rows, CUDAGraphMode.FULL, graphs, "forward_alone")
            self.run_tail = CUDAGraphWrapper(self.tail, CUDAGraphMode.FULL, graphs, "decode_tail")

    def _forward_rows(self, *args) -> None:
        hidden = self._forward(*args)
        n = self.num_rows
        last = hidden[:n] if self.rows_are_logits else hidden[self.input_batch.logits_indices[:n]]
        if last.shape[-1] != self.rows.shape[-1]:
            raise RuntimeError(f"the forward's hidden size {last.shape[-1]} is not the config's hidden_size "
                               f"{self.rows.shape[-1]}; the split decode step cannot hold its rows")
        self.rows[:n].copy_(last)

    def sample(self, desc: BatchDescriptor | None, mode: CUDAGraphMode) -> torch.Tensor:
        """The tail of the step `forward` ran last: sampled tokens [num_rows], written into the request table."""
        with forward_context(ForwardContext({}, (), desc, mode)):
            return self.run_tail(self.rows, self.num_rows)
