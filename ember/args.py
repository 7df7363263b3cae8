"""Engine arguments shared by `ember generate`, `ember bench` and `ember serve`."""

from __future__ import annotations

import argparse
import copy
import json

_TRUE, _FALSE = ("true", "on", "yes"), ("false", "off", "no")


def backend_option(text: str) -> tuple[str, object]:
    """`NAME=VALUE` of --attention-backend-option as (name, value): true/false/on/off/yes/no become booleans,
    numbers ints or floats (so `tiles=0` is the number 0; a flag reads 0/1 as off/on), anything else stays a string."""
    name, sep, raw = text.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name.isidentifier() or not raw:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. fused_decode_kv_write=off)")
    if raw.lower() in _TRUE or raw.lower() in _FALSE:
        return name, raw.lower() in _TRUE
    for kind in (int, float):
        try:
            return name, kind(raw)
        except ValueError:
            pass
    return name, raw


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends a flag's text with its default where there is one to say: a flag that takes a value and whose
    default is not None or empty (a switch's help says what it changes)."""

    def _format_action(self, action):
        shows_default = (action.option_strings and action.nargs != 0 and action.default not in (None, [])
                         and action.default is not argparse.SUPPRESS and "%(default)" not in (action.help or ""))
        if shows_default:
            action = copy.copy(action)
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add the flags that configure an engine (`LLM(...)` arguments) to a parser."""
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER_OR_HUB_ID",
                   help="the tokenizer to use, a folder or a hub id (default: the model's)")
    p.add_argument("--tokenizer-mode", default="auto",
                   help="how the tokenizer loads: 'auto' (transformers' AutoTokenizer) is the only mode")
    p.add_argument("--tokenizer-revision", default=None, help="the hub revision of the tokenizer")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV page (default: 64 on CUDA with the auto, per_phase or flash backend, else 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: e4m3 linear weights, quantized per channel at load time (an fp8 checkpoint is read as "
                        "it is stored, with or without this flag)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: e4m3 KV pages with a scale per KV head (the checkpoint's "
                        "k_scale/v_scale, else 1.0)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action="store_true", default=None,
                   help="launch step t+1 before step t's tokens reach the host (default on CUDA, off on the CPU)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="wait for each step's tokens before scheduling the next (no host/device overlap)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--attention-backend-option", dest="attention_backend_options", action="append", default=[],
                   type=backend_option, metavar="NAME=VALUE",
                   help="a switch of the attention backend, e.g. fused_decode_kv_write=off or split_launch=on "
                        "(triton_unified; repeatable)")
    p.add_argument("--compile-mode", default="auto", choices=["auto", "none", "default"])
    p.add_argument("--cudagraph-mode", default="auto")
    p.add_argument("--cudagraph-capture", default="eager", choices=["eager", "lazy"],
                   help="capture every CUDA-graph bucket at start-up, or each on its second use")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-jit-warmup", dest="jit_warmup", action="store_false", default=None,
                   help="skip the start-up steps that compile every Triton kernel specialization (default: run them "
                        "on CUDA)")
    p.add_argument("--triton-compile-workers", type=int, default=None, metavar="N",
                   help="processes that compile the start-up's Triton kernels before they run (default: one fewer "
                        "than the CPUs, at most 12, with CUDA; 0: each compiles at its first launch)")
    p.add_argument("--disable-fusion", action="append", default=[], metavar="NAME",
                   help="leave a fusion pass out of the compile (repeatable; 'all' for every pass)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split every layer over N GPUs, one process each (ember.distributed)")
    p.add_argument("--symm-mem-all-reduce", action=argparse.BooleanOptionalAction, default=None,
                   help="small all-reduces through PyTorch's symmetric-memory one-shot kernel instead of NCCL "
                        "(default: as measured on CUDA, ember.distributed.symm_mem.ON_BY_DEFAULT; off on the CPU)")
    p.add_argument("--shard-local-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="under tensor parallelism, a step that needs no whole row of logits (temperature, greedy, "
                        "grammar) samples each rank's vocabulary range instead of gathering the logits")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="under tensor parallelism, place whole MoE experts on the ranks (E/N each) instead of "
                        "splitting every expert's intermediate dimension; attention stays tensor-parallel")
    p.add_argument("--model-impl", default="auto", choices=["auto", "ember", "transformers"],
                   help="ember's own implementation of the model family, or its transformers code with ember's "
                        "paged attention (auto: ember's where it has one; `ember models` lists them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}\' '
                        '(docs/spec_decode.md)')
    p.add_argument("-v", "--verbose", action="store_true", help="log start-up decisions")


def engine_kwargs(args) -> dict:
    """The `LLM(...)` keyword arguments the parsed engine flags stand for."""
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=not args.no_prefix_caching, attention_backend=args.attention_backend,
                quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                compile_mode=args.compile_mode, cudagraph_mode=args.cudagraph_mode,
                enforce_eager=args.enforce_eager, seed=args.seed, async_scheduling=args.async_scheduling,
                disabled_fusions=tuple(args.disable_fusion), cudagraph_capture=args.cudagraph_capture,
                jit_warmup=args.jit_warmup, triton_compile_workers=args.triton_compile_workers,
                attention_backend_options=dict(args.attention_backend_options) or None, tokenizer=args.tokenizer,
                tokenizer_mode=args.tokenizer_mode, tokenizer_revision=args.tokenizer_revision,
                tensor_parallel_size=args.tensor_parallel_size, symm_mem_all_reduce=args.symm_mem_all_reduce,
                shard_local_sampling=args.shard_local_sampling, enable_expert_parallel=args.enable_expert_parallel,
                speculative_config=speculative_json(args.speculative_config), model_impl=args.model_impl)


def speculative_json(text: str | None) -> dict | None:
    """The --speculative-config flag's JSON object (None when not given)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config {text!r} is not valid JSON ({e.msg}); give an object such as "
                         f"'{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config {text!r} must be a JSON object")
    return value
