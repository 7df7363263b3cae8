"""`LLM`: the offline API, shaped like vLLM's so that its users switch by changing an import."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator, Sequence

from ember.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig, SchedulerConfig
from ember.engine.engine import Engine
from ember.sampling_params import SamplingParams
from ember.engine.request import RequestOutput

logger = logging.getLogger("ember")

PromptType = str | list[int] | dict


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.warning("no tokenizer in %s: only token-id prompts will work and outputs carry no text", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))


class LLM:
    """Load a model folder (or ember's default model) and generate from batches of prompts."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, attention_backend: str = "auto", seed: int = 0,
                 compile_mode: str = "auto", cudagraph_mode: str = "auto",
                 cudagraph_capture_sizes: Sequence[int] | None = None, enforce_eager: bool = False,
                 attention_backend_options: dict | None = None, load_format: str = "auto", tokenizer=None,
                 async_scheduling: bool = True, disabled_fusions: Sequence[str] = (),
                 cudagraph_capture: str = "eager"):
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {load_format!r} is not supported; use 'auto' or 'dummy' (random weights)")
        hf_config = None
        if load_format == "dummy" and model is not None and not Path(model).exists():
            # a bundled public config by name: random weights of the real shape, no download
            from ember.models.bundled import bundled_config
            hf_config, path = bundled_config(model), Path(model)
        else:
            from ember.models.default_model import resolve_model_path
            path = resolve_model_path(model)
        config = EngineConfig(
            model=ModelConfig(str(path), dtype, max_model_len, seed),
            cache=CacheConfig(block_size, num_kv_blocks, gpu_memory_utilization, enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, async_scheduling),
            compile=CompileConfig(compile_mode, cudagraph_mode,
                                  tuple(cudagraph_capture_sizes) if cudagraph_capture_sizes else None,
                                  enforce_eager, tuple(disabled_fusions), cudagraph_capture),
            device=device, attention_backend=attention_backend,
            attention_backend_options=tuple(sorted(dict(attention_backend_options or {}).items())),
        ).resolve()
        self.config = config
        if tokenizer is None and hf_config is None:
            tokenizer = _load_tokenizer(path)
        self.tokenizer = tokenizer
        self.engine = Engine(config, str(path), self.tokenizer, hf_config=hf_config, load_format=load_format)

    # ---- prompts ----------------------------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer, and this model folder has none; pass token ids")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, (list, tuple)):
            return list(prompt), None
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    # ---- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in input order. Bad input raises before anything runs."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts; give one or one per prompt")
        tokenized = [self._tokenize(p) for p in prompts]
        for (ids, _), p in zip(tokenized, params):
            self.engine.validate(ids, p)
        ids = [self.engine.add_request(t, p, text) for (t, text), p in zip(tokenized, params)]
        finished = {}
        try:
            for out in self._run(len(ids), use_tqdm):
                finished[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [finished[rid] for rid in ids]

    def _run(self, total: int, use_tqdm: bool) -> Iterator[RequestOutput]:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        with bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        bar.update(1)
                        yield out

    def generate_stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
                        ) -> Iterator[RequestOutput]:
        """Yield the growing output of one prompt after every step."""
        ids, text = self._tokenize(prompt)
        rid = self.engine.add_request(ids, sampling_params or SamplingParams(), text)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step(stream=True):
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(rid)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat needs a tokenizer with a chat template, and this model folder has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.chat_prompt_ids(c, add_generation_prompt, **template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(self, conversation: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def get_tokenizer(self):
        return self.tokenizer
