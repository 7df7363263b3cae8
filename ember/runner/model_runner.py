"""Coordinates one device: load the model, size and allocate the KV cache, compile and capture, and run
`execute(SchedulerOutput) -> ModelRunnerOutput` with one device-to-host copy per step."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ember.attention_backends.op import ForwardContext, forward_context
from ember.config import EngineConfig, parse_dtype
from ember.models.loader import load_config, load_model, random_model
from ember.runner.input_batch import InputBatch
from ember.runner.kv_cache_setup import allocate_kv_caches, make_builders, select_backends
from ember.runner.sampler import Sampler, SamplingMetadata
from ember.runner.scheduler import SchedulerOutput

logger = logging.getLogger("ember")

CPU_KV_CACHE_BYTES = 4 << 30   # default KV budget on the CPU, where there is no free-memory probe


@dataclass
class ModelRunnerOutput:
    """Host-side results of one step, per scheduled request in batch order."""
    sampled_token_ids: list[int]
    logprob_token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None


@dataclass
class StartupTimes:
    load_s: float = 0.0
    compile_s: float = 0.0
    capture_s: float = 0.0


class ModelRunner:
    """Owns the model, the KV cache, the persistent input buffers and the sampler on one device."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config=None, load_format: str = "auto"):
        self.config = config
        self.device = torch.device(config.device)
        self.times = StartupTimes()
        t0 = time.perf_counter()
        self.hf_config = hf_config if hf_config is not None else load_config(model_path)
        self.dtype = self._resolve_dtype(config.model.dtype)
        if load_format == "dummy":
            self.model = random_model(self.hf_config, self.dtype, self.device, seed=config.model.seed)
        else:
            self.model = load_model(model_path, self.hf_config, self.dtype, self.device)
        self.vocab_size = self.hf_config.vocab_size
        self.times.load_s = time.perf_counter() - t0

        cc, sc = config.cache, config.scheduler
        self.attn = select_backends(self.model, cc.block_size, self.dtype, self.device, config.attention_backend)
        self.max_num_tokens = sc.max_num_batched_tokens
        self.max_num_reqs = sc.max_num_seqs
        self.sampler = Sampler()
        self.num_blocks = self._num_kv_blocks()
        self.max_model_len = self._resolve_max_model_len()
        self.layer_states = allocate_kv_caches(self.attn, self.num_blocks, self.device)
        self.input_batch = InputBatch(len(self.attn.groups), cc.block_size, self.max_num_reqs, self.max_num_tokens,
                                      self.max_model_len, self.device)
        self.builders = make_builders(self.attn, self.dtype, self.device, self.max_num_reqs, self.max_num_tokens,
                                      self.max_model_len, ())
        self.forward_fn = self.model

    # ---- start-up -------------------------------------------------------------------------------------------
    def _resolve_dtype(self, dtype) -> torch.dtype:
        if dtype != "auto":
            return parse_dtype(dtype)
        if self.device.type == "cpu":
            return torch.float32
        ckpt = getattr(self.hf_config, "torch_dtype", None) or getattr(self.hf_config, "dtype", None)
        ckpt = parse_dtype(str(ckpt).replace("torch.", "")) if ckpt is not None else torch.bfloat16
        return torch.bfloat16 if ckpt == torch.float32 else ckpt

    def model_max_len(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or 1 << 20)

    def _num_kv_blocks(self) -> int:
        cc = self.config.cache
        per_block = self.attn.bytes_per_block()
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks + 1   # block 0 is the reserved null block
        wanted_len = self.config.model.max_model_len or self.model_max_len()
        if self.device.type == "cpu":
            cap = -(-wanted_len // cc.block_size) * self.max_num_reqs + 1
            return max(2, min(cap, CPU_KV_CACHE_BYTES // per_block))
        free = self._profile_free_memory()
        if free < 2 * per_block:
            raise ValueError(f"only {free / 2**30:.2f} GiB of GPU memory is left for the KV cache after loading the "
                             f"model and a profile run; raise gpu_memory_utilization ({cc.gpu_memory_utilization}) "
                             f"or lower max_num_batched_tokens ({self.max_num_tokens})")
        return int(free // per_block)

    def _profile_free_memory(self) -> int:
        """Bytes the KV cache may take: the utilisation target minus weights and the peak of a full-size step."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.max_num_tokens
        with torch.inference_mode():
            # the logits of a full batch of requests are the largest single activation
            logits = self.model.compute_logits(torch.zeros(self.max_num_reqs, self.hf_config.hidden_size,
                                                           dtype=self.dtype, device=self.device))
            del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        # activations of a full step: a generous bound of 16 hidden-sized and 4 intermediate-sized fp32 rows per token
        act = n * (16 * self.hf_config.hidden_size + 4 * getattr(self.hf_config, "intermediate_size", 0)) * 4
        return int(total * self.config.cache.gpu_memory_utilization - peak - act)

    def _resolve_max_model_len(self) -> int:
        asked = self.config.model.max_model_len
        model_len = self.model_max_len()
        capacity = (self.num_blocks - 1) * self.config.cache.block_size
        if asked is not None:
            if asked > model_len:
                raise ValueError(f"max_model_len {asked} exceeds the model's max_position_embeddings {model_len}")
            if asked > capacity:
                raise ValueError(f"max_model_len {asked} exceeds the KV cache capacity of {capacity} tokens; lower "
                                 f"max_model_len or give the cache more blocks (num_kv_blocks, gpu_memory_utilization)")
            return asked
        if model_len > capacity:
            logger.warning("max_model_len lowered from the model's %d to the KV cache capacity of %d tokens",
                           model_len, capacity)
        return min(model_len, capacity)

    # ---- the step -------------------------------------------------------------------------------------------
    def _forward(self, out: SchedulerOutput):
        batch = self.input_batch.prepare(out)
        metadata = tuple(b.build(batch.common) for b in self.builders)
        with forward_context(ForwardContext(self.layer_states, metadata)):
            hidden = self.forward_fn(batch.input_ids, batch.positions)
        return batch, hidden

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        batch, hidden = self._forward(out)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        reqs = [s.request for s in out.scheduled]
        meta = SamplingMetadata.build(
            [r.sampling_params for r in reqs], [r.sampling_seed for r in reqs], [r.output_token_ids for r in reqs],
            [r.prompt_token_ids for r in reqs], [r.eos_token_ids for r in reqs], self.vocab_size, self.device)
        result = self.sampler(logits, meta)
        return self._to_host(result)

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits of every scheduled token [num_tokens, V] (for scoring and teacher-forced checks)."""
        batch, hidden = self._forward(out)
        return self.model.compute_logits(hidden[:batch.common.num_actual_tokens])

    def _to_host(self, result) -> ModelRunnerOutput:
        # the step's single device-to-host transfer (token ids, and logprobs only when some request asked)
        if result.logprobs is None:
            return ModelRunnerOutput(result.sampled_token_ids.cpu().tolist())
        packed = torch.cat([result.sampled_token_ids[:, None].double(), result.ranks[:, None].double(),
                            result.logprob_token_ids.double(), result.logprobs.double()], dim=1).cpu()
        k = result.logprobs.shape[1]
        return ModelRunnerOutput(packed[:, 0].long().tolist(), packed[:, 2:2 + k].long().tolist(),
                                 packed[:, 2 + k:].tolist(), packed[:, 1].long().tolist())
