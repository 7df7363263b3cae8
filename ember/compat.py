"""Keyword arguments that vLLM scripts pass and ember does not take: each is refused with what to do instead.

An argument ember does not know is never ignored: the error names it, says why, and points to ember's own
argument when there is one (or to the closest spelling of one).
"""

from __future__ import annotations

import difflib
from typing import Iterable, Mapping

# where vLLM scripts configure structured output in a way ember does not need
STRUCTURED_OUTPUT_HINT = ("pass SamplingParams(structured_outputs=StructuredOutputsParams(json=... | regex=... | "
                          "choice=... | grammar=... | json_object=True)) per request")

# vLLM's LLM(...) arguments that ember does not take, with what to do instead
LLM_HINTS: dict[str, str] = {
    "structured_outputs_config": "ember's structured output runs on llguidance and needs no configuration; drop "
                                 "it (guided_decoding_backend='guidance' is accepted)",
    "swap_space": "ember preempts by recomputation and keeps no CPU swap space; drop swap_space",
    "cpu_offload_gb": "ember keeps all weights on the device; drop cpu_offload_gb",
    "pipeline_parallel_size": "ember splits a model over GPUs by tensor parallelism only; use tensor_parallel_size",
    "max_seq_len_to_capture": "use cudagraph_capture_sizes=[...] to choose the CUDA-graph batch sizes",
    "max_num_partial_prefills": "ember chunks prefills within max_num_batched_tokens; drop it",
    "enable_lora": "LoRA adapters are not supported; merge the adapter into the weights first",
    "max_lora_rank": "LoRA adapters are not supported; merge the adapter into the weights first",
    "skip_tokenizer_init": "pass token-id prompts; a model folder without a tokenizer already skips it",
    "code_revision": "ember runs no model code from the hub; drop code_revision",
    "hf_overrides": "edit the model folder's config.json instead",
    "hf_token": "log in with `huggingface-cli login` or set HF_TOKEN in the environment",
    "compilation_config": "use compile_mode=, cudagraph_mode= and cudagraph_capture_sizes=",
    "disable_custom_all_reduce": "ember's small all-reduces take the symmetric-memory one-shot kernel or NCCL "
                                 "(symm_mem_all_reduce); drop it",
    "disable_async_output_proc": "use async_scheduling=False",
    "task": "ember generates text only; drop task",
    "limit_mm_per_prompt": "ember runs text-only models; drop it",
    "mm_processor_kwargs": "ember runs text-only models; drop it",
    "enable_chunked_prefill": "ember always chunks long prefills within max_num_batched_tokens; drop it",
    "use_v2_block_manager": "ember has one block manager; drop it",
    "distributed_executor_backend": "ember starts one worker process a further GPU itself; drop it",
    "worker_cls": "ember's workers are its own; drop it",
    "load_format": "use load_format='auto' (safetensors) or 'dummy'",
}

# vLLM's SamplingParams(...) arguments that ember does not take
SAMPLING_HINTS: dict[str, str] = {
    "best_of": "it was removed from vLLM's V1 engine too; use n= (parallel samples) and rank them yourself",
    "use_beam_search": "beam search is not supported; sample n= completions instead",
    "length_penalty": "beam search is not supported, so neither is its length_penalty",
    "early_stopping": "beam search is not supported, so neither is its early_stopping",
    "bad_words": "not supported; use stop= or stop_token_ids= to end on a word instead",
    "logit_bias": "not supported; drop logit_bias",
    "allowed_token_ids": "not supported; drop allowed_token_ids",
    "logits_processors": "not supported; drop logits_processors",
    "truncate_prompt_tokens": "truncate the prompt's token ids before passing them",
    "detokenize": "outputs are always detokenized when the model folder has a tokenizer; drop detokenize",
    "spaces_between_special_tokens": "not supported; drop it (special tokens are skipped by default)",
    "output_kind": "use LLM.generate_stream for incremental outputs",
    "extra_args": "not supported; drop extra_args",
}

# vLLM's LLM.generate(...) arguments that ember does not take
GENERATE_HINTS: dict[str, str] = {
    "prompt_token_ids": "pass the ids as the prompt: TokensPrompt(prompt_token_ids=[...]) or a list of int",
    "lora_request": "LoRA adapters are not supported; merge the adapter into the weights first",
    "prompt_adapter_request": "prompt adapters are not supported; drop it",
    "guided_options_request": STRUCTURED_OUTPUT_HINT,
    "priority": "requests are served first come, first served; drop priority",
    "truncate_prompt_tokens": "truncate the prompt's token ids before passing them",
}


def unknown_argument_error(owner: str, name: str, known: Iterable[str],
                           hints: Mapping[str, str] | None = None) -> TypeError:
    """The TypeError for an argument `owner` does not take: why, and what to use instead."""
    hint = (hints or {}).get(name)
    if hint is None:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {close[0]}=?" if close else f"{owner} takes: {', '.join(sorted(known))}"
    return TypeError(f"{owner} got an unexpected keyword argument {name!r}: {hint}")


def check_kwargs(owner: str, kwargs: Mapping[str, object], known: Iterable[str],
                 hints: Mapping[str, str] | None = None) -> None:
    """Raise `unknown_argument_error` for the first argument in `kwargs` (in the caller's order)."""
    for name in kwargs:
        raise unknown_argument_error(owner, name, known, hints)


def check_llm_arguments(kwargs: Mapping[str, object], known: Iterable[str], tensor_parallel_size: int = 1) -> None:
    """Refuse what `LLM(...)` cannot honour before anything loads: unknown arguments, a tensor-parallel size that is
    not a positive int."""
    check_kwargs("LLM()", kwargs, known, LLM_HINTS)
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
        raise TypeError(f"tensor_parallel_size must be an int, got {type(tensor_parallel_size).__name__} "
                        f"{tensor_parallel_size!r}")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} must be at least 1")


def check_data_parallel_size(data_parallel_size) -> int:
    """`data_parallel_size` as a number of engine cores (TypeError or ValueError naming it)."""
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
        raise TypeError(f"data_parallel_size must be an int, got {type(data_parallel_size).__name__} "
                        f"{data_parallel_size!r}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size {data_parallel_size} must be at least 1 (the number of engine cores, "
                         f"each with its own GPU)")
    return data_parallel_size
