"""Frozen engine configuration. `resolve()` turns "auto" values into concrete ones, once, at start-up."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember.speculative_config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def cache_dir() -> Path:
    """ember's cache directory: $EMBER_CACHE, default ~/.cache/ember."""
    return Path(os.environ.get("EMBER_CACHE", Path.home() / ".cache" / "ember"))


def package_version(name: str) -> str:
    """The installed version of distribution `name`, or "absent"."""
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ("bfloat16", "fp16", ...) or a torch.dtype to a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of float32, float16, bfloat16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, hf_config) -> torch.dtype:
    """The compute dtype for `dtype` ("auto": float32 on the CPU; on a GPU the checkpoint's dtype, with a float32
    checkpoint (or none named) run in bfloat16)."""
    if dtype != "auto":
        return parse_dtype(dtype)
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    ckpt = parse_dtype(str(ckpt).replace("torch.", "")) if ckpt is not None else torch.bfloat16
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


# which implementation runs a model: "auto" takes ember's own where it has one, else the transformers fallback
MODEL_IMPLS = ("auto", "ember", "transformers")


def check_model_impl(model_impl: str) -> str:
    """`model_impl` if it is one of MODEL_IMPLS; ValueError naming the choices otherwise."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl {model_impl!r} is not known; use one of {list(MODEL_IMPLS)} ('auto': ember's "
                         f"own implementation where there is one, else transformers)")
    return model_impl


@dataclass(frozen=True)
class ModelConfig:
    """Which model to run and in which precision."""
    model: str
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # "fp8": e4m3 linear weights, quantized at load time unless the checkpoint already is (ember.quant); None:
    # the checkpoint's own quantization_config, if any
    quantization: str | None = None
    # "auto": ember's own implementation of the family where there is one, else the transformers fallback;
    # "ember" or "transformers" to force one (ember.models.registry)
    model_impl: str = "auto"


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing."""
    block_size: int | None = None          # tokens per page; None: `default_block_size` for the device and backend
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"           # "auto": the model's dtype; "fp8": e4m3 pages with a scale per layer


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits per step."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # schedule and launch step t+1 while step t runs on the device; its tokens reach the host one call later.
    # None: on with CUDA; off on the CPU, where the forward runs on the host
    # thread and nothing overlaps
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class CompileConfig:
    """torch.compile and CUDA-graph switches; see ember.graphs."""
    compile_mode: str = "auto"             # "none" | "default" | "auto" (default on CUDA, none on CPU)
    cudagraph_mode: str = "auto"           # a CUDAGraphMode name, or "auto"
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False
    # fusion passes (ember.graphs.passes) left out of the compile, by name, or ("all",)
    disabled_fusions: tuple[str, ...] = ()
    cudagraph_capture: str = "eager"       # "eager": capture every bucket at start-up; "lazy": on its second use
    # run the batch shapes and sampling settings that pick Triton kernel specializations once at start-up, so none
    # compiles inside a request (ember.runner.warmup). None: on with CUDA; off on the CPU, where kernels interpret
    jit_warmup: bool | None = None
    # worker processes that compile ember's Triton kernels for the start-up's steps before those run (ember.runner.
    # warmup.precompile), on CUDA, where an earlier start of the same build has not. None (default): one fewer than
    # the CPUs this process may use, at most 12, with CUDA (`default_compile_workers`); 0: each kernel compiles at
    # its first launch. On an H100 host (Qwen3-0.6B config, cold caches, `LLM(...)` to ready) 12 workers gave 18.5
    # and 21.5 s against 25.8 s without (ember.kernels.precompile has the history)
    triton_compile_workers: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes serve the model: `tensor_parallel_size` ranks, one a GPU, each holding a shard of every
    layer (ember.distributed); `data_parallel_size` engine cores, each with its own ranks."""
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    # how long rank 0 waits for the other ranks (their start-up, a step's result) before it reports them hung
    worker_timeout_s: float = 600.0
    # small all-reduces on CUDA through PyTorch's symmetric-memory one-shot kernel instead of NCCL
    # (ember.distributed.symm_mem); None: symm_mem.ON_BY_DEFAULT on CUDA where every GPU reaches its peers, off on
    # the CPU
    symm_mem_all_reduce: bool | None = None
    # a step whose sampling needs no whole row (temperature, greedy, grammar bitmasks) samples each rank's vocabulary
    # range and all-gathers a few partials a row instead of the [N, V] logits (ember.runner.sampler.shard_local);
    # False gathers the logits for every step (the A/B switch)
    shard_local_sampling: bool = True
    # MoE layers place whole experts on the ranks (rank r: experts [r E/N, (r+1) E/N)) instead of splitting every
    # expert's intermediate dimension; attention stays tensor-parallel (ember.models.layers.moe)
    enable_expert_parallel: bool = False

    def validate(self, device_type: str) -> None:
        """Raise ValueError naming the value when the degrees cannot be served on `device_type`."""
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be an integer of at least 1")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s {self.worker_timeout_s} must be positive")
        tp = self.tensor_parallel_size
        if device_type == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {tp} needs {tp} GPUs, and this process sees "
                             f"{torch.cuda.device_count()}; lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
        if not isinstance(self.shard_local_sampling, bool):
            raise ValueError(f"shard_local_sampling {self.shard_local_sampling!r} must be True or False")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel {self.enable_expert_parallel!r} must be True or False")
        if self.enable_expert_parallel and tp == 1:
            raise ValueError("enable_expert_parallel places the experts over the tensor-parallel ranks, and "
                             "tensor_parallel_size is 1; set tensor_parallel_size to 2 or more, or leave expert "
                             "parallelism off")
        if self.symm_mem_all_reduce and device_type != "cuda":
            raise ValueError("symm_mem_all_reduce needs CUDA; turn it off on the CPU, where gloo reduces")


# Pages of 64 tokens hold a whole KV tile of the flash prefill (one TMA box), so `auto` can pick the per-phase
# backend (prefill through flash, decode through triton_unified); 16 is the unified kernel's own default.
FLASH_BLOCK_SIZE = 64
UNIFIED_BLOCK_SIZE = 16


def default_block_size(device_type: str, attention_backend: str) -> int:
    """Tokens per KV page when none is given: FLASH_BLOCK_SIZE on CUDA for a backend that reads such pages
    ("auto", which then picks per_phase, "per_phase", "flash"), else UNIFIED_BLOCK_SIZE."""
    if device_type == "cuda" and attention_backend in ("auto", "per_phase", "flash"):
        return FLASH_BLOCK_SIZE
    return UNIFIED_BLOCK_SIZE


def default_compile_workers(device_type: str, ranks_per_host: int = 1) -> int:
    """The compile workers of `triton_compile_workers=None`: none off CUDA (nothing compiles ahead there) or on
    fewer than 4 CPUs (the workers would take the launching process's own); else one fewer than the CPUs this
    process may use, at most 12 (a cold start holds about thirty specializations; 12 workers finished them in
    1.7-2.4 s after the dry steps on an H100 host). Ranks of one host share its CPUs."""
    if device_type != "cuda":
        return 0
    cpus = usable_cpus() // max(1, ranks_per_host)
    return 0 if cpus < 4 else min(12, cpus - 1)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS tells it, else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved once."""
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    device: str = "auto"
    attention_backend: str = "auto"
    # backend-specific switches handed to every metadata builder, e.g. (("split_launch", True),)
    attention_backend_options: tuple[tuple[str, object], ...] = ()
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None     # speculative decoding (ember.spec_decode); None: off

    def resolve(self) -> "EngineConfig":
        """Return a copy with device and dtype made concrete and every limit validated."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'auto'") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for but CUDA is not available")
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'auto'")
        c, s = self.cache, self.scheduler
        if c.block_size is None:
            c = dataclasses.replace(c, block_size=default_block_size(dev.type, self.attention_backend))
        if c.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size {c.block_size} is not supported; use 8, 16, 32, 64 or 128")
        if c.num_kv_blocks is not None and c.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks {c.num_kv_blocks} must be at least 1 (or None to size from memory)")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization {c.gpu_memory_utilization} must be in (0, 1]")
        if s.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs {s.max_num_seqs} must be at least 1")
        if s.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens {s.max_num_batched_tokens} must be at least 1")
        if self.compile.cudagraph_capture not in ("eager", "lazy"):
            raise ValueError(f"cudagraph_capture {self.compile.cudagraph_capture!r} is not known; use 'eager' or 'lazy'")
        workers = self.compile.triton_compile_workers
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
            raise ValueError(f"triton_compile_workers {workers!r} must be an integer of at least 0 (0: compile each "
                             f"kernel at its first launch) or None (as many as the CPUs allow, with CUDA)")
        from ember.quant import check_kv_cache_dtype, check_quantization
        check_quantization(self.model.quantization)
        check_kv_cache_dtype(c.kv_cache_dtype)
        self.parallel.validate(dev.type)
        check_model_impl(self.model.model_impl)
        if self.model.max_model_len is not None and self.model.max_model_len < 1:
            raise ValueError(f"max_model_len {self.model.max_model_len} must be at least 1")
        spec = self.speculative
        if spec is not None and spec.method == "draft_model" and self.parallel.tensor_parallel_size > 1:
            raise ValueError("a draft model runs on one device (it would need a sharded runner of its own on every "
                             "rank); use n-gram proposals ({\"method\": \"ngram\"}) with tensor_parallel_size "
                             f"{self.parallel.tensor_parallel_size}, or tensor_parallel_size=1")
        if spec is not None and self.parallel.data_parallel_size > 1:
            raise ValueError("speculative decoding is not run by data-parallel replicas yet; use "
                             "data_parallel_size=1 or drop speculative_config")
        if s.async_scheduling is None:
            # a draft model's async path has not run on a GPU yet: on CUDA it is taken when asked for
            draft = self.speculative is not None and self.speculative.method == "draft_model"
            s = dataclasses.replace(s, async_scheduling=dev.type == "cuda" and not draft)
        comp = self.compile
        if comp.jit_warmup is None:
            comp = dataclasses.replace(comp, jit_warmup=dev.type == "cuda")
        if comp.triton_compile_workers is None:
            comp = dataclasses.replace(comp, triton_compile_workers=default_compile_workers(
                dev.type, self.parallel.tensor_parallel_size))
        return dataclasses.replace(self, device=str(dev), cache=c, scheduler=s, compile=comp)
