"""Coordinates one device: load the model, compile it, profile memory, allocate the KV cache, capture CUDA graphs,
and run `execute(StepInput) -> ModelRunnerOutput` with one device-to-host copy per step.

Each step: the `StepInput`'s deltas go into the request table and the batch layout into one packed upload; one
host-to-device copy moves them; the table scatters its writes; the prepare-inputs kernel fills the persistent input
buffers from the table; forward; the sampler reads its parameters from the table and writes the sampled tokens back
into it, where the next step (possibly launched before this one's tokens reach the host) reads them."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import astuple, dataclass

import numpy as np
import torch

from ember.attention_backends.base import StepBounds
from ember.attention_backends.op import ForwardContext, forward_context
from ember.config import EngineConfig, cache_dir, resolve_dtype
from ember.distributed.parallel_state import TP_GROUP, joined_shard
from ember.graphs.buckets import resolve_capture_sizes
from ember.graphs.compile import compile_cache_key, compile_model
from ember.graphs.cuda_graph import CUDAGraphManager
from ember.graphs.dispatcher import CudaGraphDispatcher, resolve_modes
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode
from ember.kernels.triton_key import install as install_triton_key
from ember.models.layers.onednn import onednn_packing_supported, pack_if_it_fits
from ember.models.loader import build_model, compile_identity, load_config
from ember.runner.cpu_memory import available_memory_bytes
from ember.runner.decode_tail import DecodeTail, SplitDecode, with_decode_tail
from ember.runner.input_batch import BatchLayout, InputBatch, PreparedBatch
from ember.runner.kv_cache_setup import (allocate_kv_caches, attention_workspace, free_dropped_engines, log_capacity,
                                        make_builders, num_kv_blocks, resolve_max_model_len, select_backends)
from ember.runner.output import AsyncModelRunnerOutput, DeviceOnlyOutput, HostRing, ModelRunnerOutput, StartupTimes
from ember.runner.request_table import RequestTable
from ember.runner.grammar_mask import GrammarMask
from ember.runner import constrained_step, scoring
from ember.runner.sampler import Sampler, SamplerOutput
from ember.runner.sampler.shard_local import shard_sampler_for
from ember.runner.sampling_inputs import SamplingPlan, fits_graph_tail, plan_sampling, sampling_metadata
from ember.runner.step_input import StepInput, null_block_step
from ember.runner.upload import PackedUpload
from ember.runner.warmup import collect_start_up_garbage, cycle_collector_paused, precompile, profile_run, run_warmup
from ember.sampling_params import SamplingParams
from ember.profiling import section
from ember.spec_decode.verify import make_verifier
from ember.quant import resolve_quant_config

logger = logging.getLogger("ember")


@dataclass(frozen=True)
class PreparedStep:
    """A step ready to run: its inputs in the persistent buffers, its graph mode, its sampling plan."""
    batch: PreparedBatch
    mode: CUDAGraphMode
    desc: BatchDescriptor | None
    plan: SamplingPlan
    buf: torch.Tensor                  # the step's flushed upload


class ModelRunner:
    """Owns the model, the KV cache, the persistent input buffers, the compiled forward and its CUDA graphs."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto"):
        with cycle_collector_paused():
            self._start(config, model_path, hf_config, load_format)

    def _start(self, config: EngineConfig, model_path: str, hf_config, load_format: str) -> None:
        """Load, compile, size the KV cache, capture and warm up; logs the phases' times."""
        self.config = config
        self.device = torch.device(config.device)
        self.times = StartupTimes()
        t0 = time.perf_counter()
        install_triton_key(cache_dir())     # Triton's build key from disk: it hashes its whole library otherwise
        self.hf_config = hf_config if hf_config is not None else load_config(model_path)
        self.dtype = resolve_dtype(config.model.dtype, self.device, self.hf_config)
        self.quant = resolve_quant_config(self.hf_config, config.model.quantization, self.dtype, self.device)
        free_dropped_engines(self.device)
        self.tp, self.shard = joined_shard(config.parallel.tensor_parallel_size,   # this process's rank and shard
                                           config.parallel.enable_expert_parallel)
        self.model = build_model(model_path, self.hf_config, self.dtype, self.device, load_format, config.model.seed,
                                 self.quant, self.shard, config.model.model_impl)
        self.vocab_size = self.hf_config.vocab_size
        self.times.load_s = time.perf_counter() - t0

        cc, sc = config.cache, config.scheduler
        self.max_num_tokens, self.max_num_reqs = sc.max_num_batched_tokens, sc.max_num_seqs
        self.attn = select_backends(self.model, cc.block_size, self.dtype, self.device, config.attention_backend,
                                    cc.kv_cache_dtype)
        self.modes = resolve_modes(config.compile, self.device, self.attn.backends)
        if self.modes.compile_mode == "none" and onednn_packing_supported(self.dtype, self.device):
            # eager on the CPU: oneDNN's packed GEMM runs decode-sized linear layers about twice as fast as F.linear
            pack_if_it_fits(self.model, available_memory_bytes())
        self.capture_sizes = (resolve_capture_sizes(config.compile.cudagraph_capture_sizes, self.max_num_tokens)
                              if self.modes.cudagraph_mode != CUDAGraphMode.NONE else ())
        # a tail of KV-sharing layers runs on the logits tokens only, with builders of its own; compiled, it traces
        # a row count of its own (two rows at least); under graphs request rows are padded per bucket, PIECEWISE too
        has_tail = bool(getattr(self.model, "skips_prefill", False))
        self.skip_prefill = has_tail and (self.modes.compile_mode == "none" or self.max_num_reqs >= 2)
        if has_tail and not self.skip_prefill:
            logger.info("KV-sharing layers run on every token: a compiled prefill skip needs max_num_seqs >= 2")
        # buffers are sized for the longest context the model allows; the KV cache may cap it lower below
        upper_len = config.model.max_model_len or self.model_max_len()
        self.table = RequestTable(len(self.attn.groups), cc.block_size, self.max_num_reqs, upper_len,
                                  self.vocab_size, self.device)
        self.input_batch = InputBatch(len(self.attn.groups), self.max_num_reqs, self.max_num_tokens,
                                      self.table.max_blocks, self.device, tail_metadata=has_tail)
        # sized once for the largest step (the table's writes beyond a piece go ahead in pieces): it never grows
        self.upload = PackedUpload(4 * self.max_num_tokens + 16 * self.max_num_reqs + 1024
                                   + self.table.upload_elements(), self.device)
        builder_args = (self.attn, self.dtype, self.device, self.max_num_reqs, self.max_num_tokens, upper_len,
                        self.capture_sizes, config.attention_backend_options)
        self.builders = make_builders(*builder_args)
        self.tail_builders = make_builders(*builder_args) if has_tail else []
        spec = config.speculative
        self.dispatcher = CudaGraphDispatcher(self.modes.cudagraph_mode, self.capture_sizes, self.max_num_reqs,
                                              self.modes.support, pad_piecewise_reqs=self.skip_prefill,
                                              short_context_len=self._short_context_len,
                                              verify_query_len=spec.num_speculative_tokens + 1 if spec else None,
                                              max_num_tokens=self.max_num_tokens)
        self.sampler = Sampler()
        self.grammar = GrammarMask(self.max_num_reqs, self.vocab_size, self.device,     # the engine fills and puts it
                                   TP_GROUP if self.tp.size > 1 else None)
        shard_sampler = shard_sampler_for(self.model, self.vocab_size, self.tp.size,
                                          config.parallel.shard_local_sampling)
        self.decode_tail = DecodeTail(self.model, self.sampler, self.table, self.input_batch, self.grammar.bitmask,
                                      rows_are_logits=self.skip_prefill, shard_sampler=shard_sampler)
        self.host_ring = HostRing(self.max_num_reqs, self.device) if self.device.type == "cuda" else None
        self.graphs = (CUDAGraphManager(self.device, lazy=config.compile.cudagraph_capture == "lazy")
                       if self.modes.cudagraph_mode != CUDAGraphMode.NONE else None)
        self.forward_fn = self._build_forward()
        self.verifier = make_verifier(self, config)

        # a full-size step against a two-block cache compiles the model and measures the activation peak
        tail_offset = len(self.builders) if self.tail_builders else 0   # where KV-sharing layers read metadata
        self.layer_states = allocate_kv_caches(self.attn, 2, self.device, tail_offset)
        self.times.precompile_s = precompile(self)     # CUDA: the start-up's Triton kernels, in worker processes
        self.activation_peak = (profile_run(self) if self.device.type == "cuda" or self.modes.compile_mode != "none"
                                else 0)
        # the attention's worst case: the largest step against the longest context (docs/memory.md)
        self.attention_workspace = attention_workspace(self.attn, self.dtype, StepBounds(
            self.max_num_tokens, self.max_num_reqs, upper_len), builder_sets=2 if self.tail_builders else 1)
        self.num_blocks = num_kv_blocks(self.attn, config.cache, self.model, self.device, upper_len,
                                        self.max_num_reqs, self.max_num_tokens, self.activation_peak,
                                        self.attention_workspace)
        self.max_model_len = resolve_max_model_len(self.attn, config.model.max_model_len, self.model_max_len(),
                                                   self.num_blocks, self.max_num_tokens)
        self._log_capacity()
        self.layer_states = allocate_kv_caches(self.attn, self.num_blocks, self.device, tail_offset)
        if self.graphs is not None:
            self._capture()
        if config.compile.jit_warmup or (config.compile.jit_warmup is None and self.device.type == "cuda"):
            # under lazy capture the warm-up's steps run without graphs: they must not count as a bucket's uses
            with self.graphs.pause() if self.graphs is not None and self.graphs.lazy else contextlib.nullcontext():
                self.times.warmup_s = run_warmup(self)
            collect_start_up_garbage()      # where the first run's time matters; a test process's heap is large
        logger.info("start-up %s", self.times.summary(time.perf_counter() - t0))

    # ---- start-up -------------------------------------------------------------------------------------------
    def _short_context_len(self, num_reqs_padded: int) -> int | None:
        """The request length up to which a decode bucket's builders plan short-context kernels (the shortest
        any builder asks for), or None: such buckets get a second FULL graph (see `CudaGraphDispatcher`)."""
        bounds = [n for b in self.builders + self.tail_builders if (n := b.short_context_len(num_reqs_padded))]
        return min(bounds) if bounds else None

    def shutdown(self) -> None:
        """Nothing to stop: one process (the multi-process executor's counterpart stops its workers)."""

    def release_graphs(self) -> int:
        """Drop the captured CUDA graphs (a rank does before it leaves its group); how many."""
        return self.graphs.release() if self.graphs is not None else 0

    def model_max_len(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or 1 << 20)

    def _build_forward(self):
        mode = self.modes.compile_mode
        key = (compile_cache_key(self.hf_config.to_dict(), self.dtype, device=self.device,
                                 settings={"capture_sizes": list(self.capture_sizes), "prefill_skip": self.skip_prefill,
                                           "quantization": repr(self.quant),
                                           "disabled_fusions": list(self.config.compile.disabled_fusions),
                                           "tensor_parallel": astuple(self.shard),   # a rank's own shard
                                           # which layers hand q and k to their backend unrotated (traced code)
                                           "fuse_rope": sorted(n for n, a in self.attn.layers.items() if a.fuse_rope),
                                           **compile_identity(self.model)})
               if mode != "none" else None)
        piecewise = self.graphs if self.modes.cudagraph_mode.has_piecewise else None
        forward = compile_model(self.model, mode, cache_key=key, graph_manager=piecewise,
                                disabled_fusions=self.config.compile.disabled_fusions)
        self.compile_stats = getattr(forward, "stats", None)    # None when running eager
        self._forward_samples = self.modes.cudagraph_mode.has_full
        self.split = SplitDecode(forward, self.decode_tail, self.graphs if self._forward_samples else None,
                                 self.max_num_reqs, self.hf_config.hidden_size, self.dtype, self.device,
                                 rows_are_logits=self.skip_prefill,
                                 share=self.grammar.share if self.tp.size > 1 else None)
        if self._forward_samples:
            forward = self.graphs.wrap_full(with_decode_tail(forward, self.decode_tail))
        return forward

    def _run(self, batch: PreparedBatch, mode: CUDAGraphMode = CUDAGraphMode.NONE,
             desc: BatchDescriptor | None = None, skip: bool | None = None, fn=None) -> tuple[torch.Tensor, ...]:
        """The forward (`fn`, else `forward_fn`): hidden [num_tokens_padded, H], or with `skip` (None: `skip_prefill`)
        the logits tokens' rows [num_reqs_padded, H]; and the tokens the decode tail sampled (or None)."""
        skip = self.skip_prefill if skip is None else skip
        metadata = tuple(b.build(batch.common) for b in self.builders)
        if self.tail_builders:   # the KV-sharing layers' metadata: one query per request, or the whole batch
            metadata += tuple(b.build(batch.tail if skip else batch.common) for b in self.tail_builders)
        with forward_context(ForwardContext(self.layer_states, metadata, desc, mode)):
            if skip:
                rows = (batch.logits_indices_padded,)
            elif self.skip_prefill and self.modes.compile_mode != "none":   # traced with the rows: pass them all
                rows = (torch.arange(batch.input_ids.shape[0], device=self.device),)
            else:
                rows = ()
            out = (fn or self.forward_fn)(batch.input_ids, batch.positions, *rows)
        return out if self._forward_samples and fn is None else (out, None)

    def _logits_hidden(self, batch: PreparedBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Each request's last token's hidden state [num_reqs, H] from a forward's output."""
        return hidden[:batch.logits_indices.shape[0]] if self.skip_prefill else hidden[batch.logits_indices]

    def _log_capacity(self) -> None:
        self.kv_capacity_tokens, self.kv_full_equivalent_tokens = log_capacity(
            self.attn, self.num_blocks, self.max_model_len, self.config.cache.block_size, self.dtype)

    @torch.inference_mode()
    def _capture(self) -> None:
        def run_step(mode: CUDAGraphMode, desc: BatchDescriptor) -> None:
            num_reqs = desc.num_reqs if desc.uniform_decode else 1
            self._dummy_forward(desc.num_tokens, num_reqs, mode, desc)

        captures = self.dispatcher.capture_list()
        if self.graphs.lazy:
            logger.info("CUDA graphs of %d descriptors are captured lazily, each on its second use", len(captures))
            return
        report = self.graphs.capture_all(run_step, captures)
        self.times.capture_s = report.seconds
        self.times.graph_memory_bytes = report.memory_bytes

    def _dummy_forward(self, num_tokens: int, num_reqs: int, mode: CUDAGraphMode = CUDAGraphMode.NONE,
                       desc: BatchDescriptor | None = None, skip: bool | None = None, lens=None, context_len: int = 0):
        """Run a step of the given shape (or query `lens`) for warm-up, profiling or capture: requests of token 0
        whose blocks are all the null block (`context_len` tokens of it before each query), added to the table
        and dropped again. Returns what `_run` does."""
        if lens is None:
            num_reqs = max(1, min(num_reqs, num_tokens), -(-num_tokens // self.table.max_model_len))
            lens = [num_tokens // num_reqs + (r < num_tokens % num_reqs) for r in range(num_reqs)]
        num_reqs = len(lens)
        step = null_block_step("__dummy", lens, [_DUMMY_PARAMS] * num_reqs, self.config.cache.block_size,
                               len(self.attn.groups), context_len)
        padded = num_reqs if desc is None else max(desc.padded_num_reqs(num_reqs), num_reqs)
        try:
            layout, seg, buf = self._stage(step, padded)
            batch = self.input_batch.prepare(self.table, layout, seg, buf, num_tokens if desc is None
                                             else desc.num_tokens, padded,
                                             *self._graph_batch(desc))
            return self._run(batch, mode, desc, skip)
        finally:
            for r in step.new_requests:
                self.table.remove(r.req_id)

    # ---- the step -------------------------------------------------------------------------------------------
    @staticmethod
    def _graph_batch(desc: BatchDescriptor | None, graph: bool = True) -> tuple[bool | None, int | None]:
        """What attention plans a graph's step on beyond its sizes, (uniform decode, longest request bound), or
        (None, None) to plan on the live batch."""
        return (desc.uniform_decode, desc.max_seq_len) if desc is not None and graph else (None, None)

    def _stage(self, step: StepInput, num_reqs_padded: int | None = None
               ) -> tuple[BatchLayout, tuple[int, int], torch.Tensor]:
        """Apply a step that samples nothing to the table and flush its one upload; returns the layout, the
        segment of its batch rows and the flushed device buffer."""
        upload = self.upload
        upload.begin()
        self.table.apply(step, upload)
        layout = self._layout(step)
        seg = self.input_batch.stage(layout, num_reqs_padded or layout.num_reqs, upload, self.table.width - 1)
        buf = upload.flush()
        self.table.commit(buf)
        return layout, seg, buf

    def _layout(self, step: StepInput) -> BatchLayout:
        rows = self.table.rows_of(step.req_ids)
        n = len(rows)
        return BatchLayout(rows, np.fromiter(step.num_computed_tokens, dtype=np.int64, count=n),
                           np.fromiter(step.num_scheduled_tokens, dtype=np.int64, count=n), step.num_decodes)

    @torch.inference_mode()   # the table's tensors are inference tensors
    def update_table(self, step: StepInput) -> None:
        """Apply a step that schedules nothing (rows of finished requests leave the table)."""
        if not step.is_empty:
            raise ValueError(f"update_table takes a step without a batch; this one schedules {step.num_reqs} requests")
        self.upload.begin()
        self.table.apply(step, self.upload)
        self.table.commit(self.upload.flush())

    @torch.inference_mode()
    def execute(self, step: StepInput) -> ModelRunnerOutput:     # run one step and wait for its tokens
        return self.execute_async(step).result()

    @torch.inference_mode()
    def execute_async(self, step: StepInput) -> AsyncModelRunnerOutput:
        """Launch one step (forward, sampling, the copy of its tokens to the host) without waiting for the device.
        The sampled tokens are written into the request table on the device, so the next step may be launched
        while this one is still in flight. A step with proposals runs as a verify step (ember.spec_decode); a step
        with grammar rows runs in two launches instead (`launch_forward`, `launch_sample`), its bitmask put between."""
        if step.spec_token_ids or (self.verifier is not None and self.verifier.every_step):
            return self.verifier.execute_async(step)
        prepared = self.prepare_step(step)
        return self.sample_step(prepared, *self.forward(prepared))

    def forward(self, prepared: "PreparedStep") -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the step's forward: (hidden, the tokens a decode graph sampled or None)."""
        with section("ember.forward"):
            return self._run(prepared.batch, prepared.mode, prepared.desc)

    # a step with grammar rows: its forward, then its sampling once the bitmask is put (`runner.constrained_step`)
    launch_forward, launch_sample = constrained_step.launch_forward, constrained_step.launch_sample
    graph_samples, forward_alone, sample_alone = (constrained_step.graph_samples, constrained_step.forward_alone,
                                                  constrained_step.sample_alone)

    def prepare_step(self, step: StepInput) -> "PreparedStep":
        """Apply the step to the table, send its one upload and fill the input buffers; picks the graph mode."""
        if step.is_empty:
            raise ValueError("a step needs at least one scheduled request; use update_table for table changes only")
        table, upload = self.table, self.upload
        num_reqs = step.num_reqs
        mode, desc = self._dispatch(step)
        num_reqs_padded = desc.padded_num_reqs(num_reqs)
        with section("ember.prepare"):
            upload.begin()
            table.apply(step, upload)
            layout = self._layout(step)
            ends = layout.starts + layout.query_lens
            batch_seg = self.input_batch.stage(layout, num_reqs_padded, upload, table.width - 1,
                                               table.sample_index(layout.rows, ends), step.grammar_rows)
            plan = plan_sampling(table, layout.rows, ends, upload, len(step.grammar_rows))
            buf = upload.flush()
            table.commit(buf)
            batch = self.input_batch.prepare(table, layout, batch_seg, buf, desc.num_tokens, num_reqs_padded,
                                             *self._graph_batch(desc, mode == CUDAGraphMode.FULL))
        return PreparedStep(batch, mode, desc, plan, buf)

    def _dispatch(self, step: StepInput) -> tuple[CUDAGraphMode, BatchDescriptor]:
        num_reqs = step.num_reqs
        uniform = step.num_decodes == num_reqs
        # a uniform decode's requests are each one token past their computed context
        longest = (max(step.num_computed_tokens) + 1 if uniform and num_reqs <= self.dispatcher.short_decode_max_reqs
                   else None)
        widest = max(step.num_scheduled_tokens) if self.dispatcher.verify_sizes and not uniform else None
        return self.dispatcher.dispatch(step.total_num_tokens, num_reqs, uniform, longest, widest)

    def sample_step(self, prepared: "PreparedStep", hidden: torch.Tensor,
                    tokens: torch.Tensor | None = None) -> AsyncModelRunnerOutput:
        """Sample from the step's hidden states, write the tokens into the table and start their copy to the host;
        `tokens`, those a decode graph already sampled and wrote, stand when the step's plan fits the graph (with
        grammar rows, the caller passes them only if the bitmask was put before the forward)."""
        batch = prepared.batch
        num_reqs = batch.common.num_reqs
        fits = fits_graph_tail(prepared.plan)       # needs no whole row: shard-local under tensor parallelism
        self.decode_tail.count(fits)
        if tokens is not None and fits:
            sampled = SamplerOutput(tokens[:num_reqs], None, None, None)
        else:
            with section("ember.sample"):
                meta = sampling_metadata(self.table, prepared.plan, batch.idx_mapping,
                                         batch.common.seq_lens[:num_reqs], prepared.buf, self.grammar.bitmask,
                                         batch.mask_index[:num_reqs])
                sampled = self.decode_tail.sample(self._logits_hidden(batch, hidden), meta, fits)
                self.table.write_sampled(batch.sample_index[:num_reqs], sampled.sampled_token_ids)
        if not self.tp.is_driver:       # every rank samples the same tokens into its table; rank 0 reports them
            return DeviceOnlyOutput()
        with section("ember.to_host"):
            return AsyncModelRunnerOutput(sampled, self.device, self.host_ring)

    @torch.inference_mode()
    def all_logits(self, step: StepInput) -> torch.Tensor:
        """Logits of every scheduled token [num_tokens, V] (for scoring and teacher-forced checks)."""
        return self.model.compute_logits(scoring.step_hidden(self, step))

    def prompt_logprobs(self, step: StepInput, k: int) -> tuple[torch.Tensor, ...]:
        """The prompt logprobs of the one sequence `step` scores, in chunks of rows (`scoring.prompt_logprobs`)."""
        return scoring.prompt_logprobs(self, step, k)

# warm-up rows sample greedily (the profile run measures sampling separately, with filters on)
_DUMMY_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)
