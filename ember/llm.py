"""`LLM`: the offline API, shaped like vLLM's so that its users switch by changing an import."""

from __future__ import annotations

import inspect
import json
import logging
import operator
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from ember.chat_input import chat_prompt_ids, chat_prompt_text, check_conversations, check_text
from ember.compat import GENERATE_HINTS, check_data_parallel_size, check_kwargs, check_llm_arguments
from ember.models.architecture_check import check_architecture
from ember.config import (CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                          check_model_impl)
from ember.engine.engine import Engine, EngineStepError, token_id_list
from ember.quant import check_kv_cache_dtype, check_quantization
from ember.sampling_params import SamplingParams, check_grammar_backend
from ember.speculative_config import SpeculativeConfig
from ember.engine.request import RequestOutput
from ember.runner.warmup import cycle_collector_paused

logger = logging.getLogger("ember")

PromptType = str | list[int] | dict


def _load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.warning("no tokenizer in %s: only token-id prompts will work and outputs carry no text", path)
        return None
    config = _tokenizer_model_config(path)
    if config is not None:
        try:
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, config=config)
        except (AttributeError, KeyError, TypeError, ValueError):
            pass        # a transformers version that reads more of the config: let it load its own (a folder that
                        # is broken raises there again)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def _tokenizer_model_config(path: Path):
    """The model config to hand AutoTokenizer, or None to let it load its own.

    AutoTokenizer loads the model's config to pick the tokenizer class, and a transformers config class imports much
    of transformers (on a 2-core CPU the SmolLM2-135M-Instruct tokenizer loaded in 2.35-2.91 s, 0.46-0.48 s without
    those imports). Where tokenizer_config.json names its class and no remote code (`auto_map`), AutoTokenizer
    reads only the config's model type and names, which ember's snapshot of it (`load_config`, the same object the
    runner loads) has; it is handed over with this folder as its name."""
    from ember.models.config_snapshot import ConfigSnapshot
    from ember.models.loader import CheckpointError, load_config
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    names_its_class = isinstance(tokenizer_config, dict) and bool(tokenizer_config.get("tokenizer_class"))
    if not names_its_class or "auto_map" in tokenizer_config:
        return None
    try:
        config = load_config(path)
    except CheckpointError:
        return None
    return ConfigSnapshot(**{**vars(config), "_name_or_path": str(path)})


@dataclass(frozen=True)
class EngineSetup:
    """What starting an engine takes, resolved from `LLM(...)`'s arguments: the config, the model folder, a bundled
    config for random weights (else None), how to load the weights, the tokenizer (None if there is none) and
    which weights these are."""
    config: EngineConfig
    model_path: str
    hf_config: object
    load_format: str
    tokenizer: object
    checkpoint: object


# the cycle collector waits for the end of the start-up, the tokenizer's load included (ember.runner.warmup)
@cycle_collector_paused()
def engine_setup(model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, block_size: int | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, attention_backend: str = "auto", seed: int = 0,
                 compile_mode: str = "auto", cudagraph_mode: str = "auto",
                 cudagraph_capture_sizes: Sequence[int] | None = None, enforce_eager: bool = False,
                 attention_backend_options: dict | None = None, load_format: str = "auto",
                 tokenizer: str | None = None, tokenizer_mode: str = "auto", tokenizer_revision: str | None = None,
                 async_scheduling: bool | None = None, disabled_fusions: Sequence[str] = (),
                 cudagraph_capture: str = "eager", jit_warmup: bool | None = None,
                 triton_compile_workers: int | None = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, worker_timeout_s: float = 600.0, symm_mem_all_reduce: bool | None = None,
                 shard_local_sampling: bool = True, enable_expert_parallel: bool = False,
                 trust_remote_code: bool = False, revision: str | None = None, download_dir: str | None = None,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 speculative_config: dict | None = None, model_impl: str = "auto") -> EngineSetup:
    """Check the arguments, find the model (fetching the default one if none is named), resolve the config and load
    the tokenizer; `LLM(...)` and `ember serve` start their engines from this."""
    check_quantization(quantization)
    check_model_impl(model_impl)
    check_kv_cache_dtype(kv_cache_dtype)
    check_data_parallel_size(data_parallel_size)
    speculative = SpeculativeConfig.from_dict(speculative_config)     # a bad value fails before the model loads
    if attention_backend != "auto":      # a misspelt name fails now, not after the model has loaded
        from ember.attention_backends.registry import get_backend
        get_backend(attention_backend)
    if attention_backend_options:
        from ember.attention_backends.registry import check_backend_options
        check_backend_options(dict(attention_backend_options), attention_backend)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not supported; use 'auto' or 'dummy' (random weights)")
    from ember.tokenizer_args import check_tokenizer_mode, tokenizer_folder
    check_tokenizer_mode(tokenizer_mode)
    # a tokenizer of its own resolves first: a wrong one fails before the model is fetched or built
    tokenizer_path = tokenizer_folder(tokenizer, tokenizer_revision, model, None, download_dir)
    hf_config = None
    if load_format == "dummy" and model is not None and not Path(model).exists():
        # a bundled public config by name: random weights of the real shape, no download
        from ember.models.bundled import bundled_config
        hf_config, path = bundled_config(model), Path(model)
    else:
        from ember.models.default_model import resolve_model_path
        path = resolve_model_path(model, revision, download_dir)
        check_architecture(path, trust_remote_code, model_impl)
    from ember.models.checkpoint_origin import checkpoint_origin
    checkpoint = checkpoint_origin(model, path, load_format)   # which weights these are, said once
    if checkpoint.warning:
        logger.warning("%s", checkpoint.warning)
    logger.info("weights: %s", checkpoint.describe())
    config = EngineConfig(
        model=ModelConfig(str(path), dtype, max_model_len, seed, quantization, model_impl),
        cache=CacheConfig(block_size, num_kv_blocks, gpu_memory_utilization, enable_prefix_caching,
                          kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, async_scheduling),
        compile=CompileConfig(compile_mode, cudagraph_mode,
                              tuple(cudagraph_capture_sizes) if cudagraph_capture_sizes else None,
                              enforce_eager, tuple(disabled_fusions), cudagraph_capture, jit_warmup,
                              triton_compile_workers),
        device=device, attention_backend=attention_backend,
        attention_backend_options=tuple(sorted(dict(attention_backend_options or {}).items())),
        parallel=ParallelConfig(tensor_parallel_size, data_parallel_size, worker_timeout_s=worker_timeout_s,
                                symm_mem_all_reduce=symm_mem_all_reduce,
                                shard_local_sampling=shard_local_sampling,
                                enable_expert_parallel=enable_expert_parallel),
        speculative=speculative,
    ).resolve()
    if tokenizer_path is None and hf_config is None:     # the model folder's own
        tokenizer_path = path
    loaded = _load_tokenizer(tokenizer_path, trust_remote_code) if tokenizer_path is not None else None
    return EngineSetup(config, str(path), hf_config, load_format, loaded, checkpoint)


def start_engine_cores(setup: EngineSetup):
    """The engine cores of `setup` in processes of their own (`config.parallel.data_parallel_size` of them), behind
    one client."""
    from ember.engine.core_client import MPClient
    return MPClient(setup.config, setup.model_path, setup.hf_config, setup.load_format,
                    setup.tokenizer, setup.config.parallel.data_parallel_size)


class LLM:
    """Load a model folder (or ember's default model) and generate from batches of prompts.

    The engine core runs in this process by default. `engine_process=True` runs it in a process of its own (the
    outputs are the same; this process keeps the tokenizer and the text), and `data_parallel_size=N` runs N of
    them, each on its own GPUs (N processes on the CPU), each request going to the least-loaded one. `shutdown()`
    stops such processes (they also stop when this process exits)."""

    # the cycle collector waits for the end of the start-up, the tokenizer's load included (ember.runner.warmup)
    @cycle_collector_paused()
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, block_size: int | None = None, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, attention_backend: str = "auto", seed: int = 0,
                 compile_mode: str = "auto", cudagraph_mode: str = "auto",
                 cudagraph_capture_sizes: Sequence[int] | None = None, enforce_eager: bool = False,
                 attention_backend_options: dict | None = None, load_format: str = "auto",
                 tokenizer: str | None = None, tokenizer_mode: str = "auto", tokenizer_revision: str | None = None,
                 async_scheduling: bool | None = None, disabled_fusions: Sequence[str] = (),
                 cudagraph_capture: str = "eager", jit_warmup: bool | None = None,
                 triton_compile_workers: int | None = None, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, engine_process: bool = False,
                 worker_timeout_s: float = 600.0, symm_mem_all_reduce: bool | None = None,
                 shard_local_sampling: bool = True, enable_expert_parallel: bool = False,
                 trust_remote_code: bool = False, revision: str | None = None, download_dir: str | None = None,
                 quantization: str | None = None, kv_cache_dtype: str = "auto",
                 speculative_config: dict | None = None, model_impl: str = "auto",
                 guided_decoding_backend: str | None = None, **kwargs):
        check_llm_arguments(kwargs, _LLM_PARAMETERS, tensor_parallel_size)
        # structured output runs on llguidance; vLLM's name for it ('guidance') and 'auto' are accepted
        check_grammar_backend(guided_decoding_backend, "guided_decoding_backend")
        if not isinstance(engine_process, bool):
            raise TypeError(f"engine_process must be a bool, got {type(engine_process).__name__} {engine_process!r}")
        setup = engine_setup(
            model, dtype=dtype, device=device, max_model_len=max_model_len, block_size=block_size,
            num_kv_blocks=num_kv_blocks, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend, seed=seed, compile_mode=compile_mode,
            cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=cudagraph_capture_sizes,
            enforce_eager=enforce_eager, attention_backend_options=attention_backend_options,
            load_format=load_format, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode,
            tokenizer_revision=tokenizer_revision, async_scheduling=async_scheduling,
            disabled_fusions=disabled_fusions, cudagraph_capture=cudagraph_capture, jit_warmup=jit_warmup,
            triton_compile_workers=triton_compile_workers, tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size, worker_timeout_s=worker_timeout_s,
            symm_mem_all_reduce=symm_mem_all_reduce, shard_local_sampling=shard_local_sampling,
            enable_expert_parallel=enable_expert_parallel,
            trust_remote_code=trust_remote_code, revision=revision,
            download_dir=download_dir, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            speculative_config=speculative_config, model_impl=model_impl)
        self.setup = setup
        self.config = setup.config
        self.checkpoint = setup.checkpoint
        self.tokenizer = setup.tokenizer
        client = start_engine_cores(setup) if engine_process or data_parallel_size > 1 else None
        self.engine = Engine(setup.config, setup.model_path, self.tokenizer, hf_config=setup.hf_config,
                             load_format=setup.load_format, client=client)
        # requests a live generate() or stream waits for: the latest output of each (outputs are cumulative, so
        # the latest is all a waiter needs), and the error of each that a failed step aborted
        self._latest: dict[str, RequestOutput | None] = {}
        self._streams: set[str] = set()
        self._errors: dict[str, EngineStepError] = {}

    def shutdown(self) -> None:
        """Stop the engine core's processes, if it runs in any (`engine_process`, `data_parallel_size`)."""
        self.engine.shutdown()

    # ---- prompts ----------------------------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return token_id_list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt must be a str, got {type(prompt).__name__} {prompt!r}")
            else:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this model folder has none; pass token ids")
            return self.tokenizer.encode(check_text(prompt, "prompt")), prompt
        if isinstance(prompt, (list, tuple)):
            return token_id_list(prompt), None
        raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__} "
                        f"{prompt!r}")

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, **kwargs) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in input order. Bad input raises before anything runs."""
        check_kwargs("LLM.generate()", kwargs, ("prompts", "sampling_params", "use_tqdm"), GENERATE_HINTS)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and _is_token_id(prompts[0])):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids, a dict or a list of these, got "
                            f"{type(prompts).__name__} {prompts!r}")
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one per prompt")
        tokenized = [self._tokenize(p) for p in prompts]
        for (ids, _), p in zip(tokenized, params):
            self.engine.validate(ids, p)
        from tqdm.auto import tqdm
        scored = {i: self._prompt_logprobs(t, p) for i, ((t, _), p) in enumerate(zip(tokenized, params))
                  if p.prompt_logprobs is not None}
        ids = []
        try:
            with self.engine.client.batch():     # one batch, as the in-process core sees it
                for (t, text), p in zip(tokenized, params):
                    ids.append(self.engine.add_request(t, p, text))
                    self._latest[ids[-1]] = None
            pending = list(ids)
            # on stderr, and only on a terminal: logs and pipes get no carriage-return noise
            with tqdm(total=len(ids), desc="Generating", unit="req", file=sys.stderr, dynamic_ncols=True,
                      disable=not (use_tqdm and sys.stderr.isatty())) as bar:
                while pending:
                    self._pump(pending)
                    done = [rid for rid in pending if self._latest[rid] is not None and self._latest[rid].finished]
                    bar.update(len(done))
                    pending = [rid for rid in pending if rid not in done]
            outputs = [self._latest[rid] for rid in ids]
            for i, entries in scored.items():
                outputs[i].prompt_logprobs = entries
            return outputs
        finally:
            for rid in ids:
                self._forget(rid)

    def _pump(self, mine: list[str]) -> None:
        """Run one engine step and keep each output for the call that waits for it; raise the error of a failed
        step if it aborted one of `mine` (the caller's requests)."""
        for rid in mine:
            if rid in self._errors:
                raise self._errors.pop(rid)
        if not self.engine.has_unfinished():
            raise RuntimeError(f"requests {mine} are no longer in the engine")
        try:
            outputs = self.engine.step(stream=bool(self._streams))
        except EngineStepError as e:
            # its requests' final outputs come with the next step; the error goes to whoever waits for them
            for rid in e.request_ids:
                if rid in self._latest:
                    self._errors[rid] = e
            if any(rid in self._errors for rid in mine):
                raise
            return
        for out in outputs:
            if out.request_id in self._latest and (out.finished or out.request_id in self._streams):
                self._latest[out.request_id] = out

    def _forget(self, rid: str) -> None:
        """Drop a request this LLM waited for, aborting it in the engine if it is still there."""
        self._latest.pop(rid, None)
        self._streams.discard(rid)
        self._errors.pop(rid, None)
        self.engine.abort(rid)

    def _prompt_logprobs(self, token_ids: list[int], params: SamplingParams) -> list | None:
        # one teacher-forced pass of the prompt through the paged cache before the request is queued, so that the
        # sampling path stays as it is; the request's own prefill then runs as usual
        return self.engine.prompt_logprobs(token_ids, params.prompt_logprobs)

    def generate_stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield the growing output of one prompt after every step. Bad input raises here; the request is queued
        when the iteration starts and aborted if the iterator is closed before it finishes. Several streams may
        be read in turns: each gets every output of its own request."""
        ids, text = self._tokenize(prompt)
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.engine.validate(ids, params)
        return self._stream(ids, params, text)

    def _stream(self, ids: list[int], params: SamplingParams, text: str | None) -> Iterator[RequestOutput]:
        scored = self._prompt_logprobs(ids, params) if params.prompt_logprobs is not None else None
        rid = self.engine.add_request(ids, params, text)
        self._latest[rid] = None
        self._streams.add(rid)
        try:
            while True:
                out = self._latest[rid]
                if out is None:
                    self._pump([rid])
                    continue
                self._latest[rid] = None
                out.prompt_logprobs = scored
                yield out
                if out.finished:
                    return
        finally:
            self._forget(rid)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template, and this model folder has none")
        conversations = check_conversations(messages)
        prompts = []
        for c in conversations:
            text = self.chat_prompt_text(c, add_generation_prompt, **template_kwargs)
            prompts.append({"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_text(self, conversation: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """One checked conversation rendered by the tokenizer's chat template."""
        return chat_prompt_text(self.tokenizer, conversation, add_generation_prompt, **kwargs)

    def chat_prompt_ids(self, conversation: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The token ids of the rendered conversation (the template carries its own special tokens)."""
        return chat_prompt_ids(self.tokenizer, conversation, add_generation_prompt, **kwargs)

    def get_tokenizer(self):
        return self.tokenizer


def _is_token_id(value) -> bool:
    """Whether `value` is an int or a numpy/torch integer (a bool is not a token id)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


_LLM_PARAMETERS = tuple(p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "kwargs"))
