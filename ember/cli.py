"""`ember generate`, `ember serve`, `ember backends`, `ember models`, `ember bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from ember.args import DefaultsHelpFormatter, add_engine_args, engine_kwargs


def _one_model(args) -> None:
    """The model is given once: as the positional MODEL or as --model (both, if they agree)."""
    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise ValueError(f"give the model once: {args.model_path!r} or --model {args.model!r}")
        args.model = args.model_path


def _generate(args) -> int:
    from ember import LLM, SamplingParams
    _one_model(args)
    # sampling arguments are checked before the model loads
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.sample_seed, ignore_eos=args.ignore_eos,
                            stop=args.stop or None)
    if not args.prompt:
        raise ValueError("--prompt is empty; give the text to continue (or to answer, with --chat)")
    llm = LLM(args.model, **engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": llm.chat_prompt_ids([{"role": "user", "content": args.prompt}])}
    printed = 0
    for out in llm.generate_stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[printed:])
        sys.stdout.flush()
        printed = len(text)
    sys.stdout.write("\n")
    return 0


def _serve(args) -> int:
    _one_model(args)
    try:
        import ember.serve.app  # noqa: F401 - fails early, before the model loads, without the extras
        import msgspec  # noqa: F401 - the engine core's messages
        import zmq  # noqa: F401 - and their sockets
        from ember.serve.server import main as serve_main
    except ImportError as exc:
        raise ValueError(f"ember serve needs the server extras ({exc.name} is missing): "
                         f"pip install 'ember[serve]'") from None
    return serve_main(args)


def _backends(args) -> int:
    from ember.attention_backends.registry import available_backends, get_backend
    for name in available_backends():
        try:
            b = get_backend(name)
            summary = " ".join((b.__doc__ or "").split())
            print(f"{name:16s} priority {b.priority:3d}  cudagraph {b.cudagraph_support.name:28s} {summary}".rstrip())
        except Exception as exc:   # a plug-in that fails to import is listed with the reason
            print(f"{name:16s} unavailable: {exc}")
    print()
    for line in _auto_choice(args.device, args.block_size):
        print(line)
    return 0


def _auto_choice(device: str, block_size: int | None) -> list[str]:
    """What `attention_backend="auto"` picks here for a typical layer (bf16 on CUDA, else float32; 32 query and 8
    KV heads of 128) on the default pages, and why the others were passed over."""
    import torch

    from ember.attention_backends.base import AttentionLayerOptions
    from ember.attention_backends.registry import BackendSelectionError, available_backends, select_backend
    from ember.config import default_block_size
    from ember.kv_spec import KVCacheSpec
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    pages = block_size or default_block_size(dev.type, "auto")
    layer = AttentionLayerOptions(32, 8, 128, 128 ** -0.5)
    head = f"auto on {dev.type}, {str(dtype).removeprefix('torch.')}, {pages}-token pages, 32/8 heads of 128"
    try:
        sel = select_backend(KVCacheSpec(pages, 8, 128, dtype), dtype, dev, [layer])
    except BackendSelectionError as exc:
        return [f"{head}: none ({exc})"]
    lines = [f"{head}: {sel.backend.describe()}"]
    lines += [f"  passed over {name}: {'; '.join(reasons)}" for name, reasons in sorted(sel.refused.items())]
    lower = [n for n in available_backends() if n not in sel.refused and n != sel.backend.name]
    if lower:
        lines.append(f"  also able, lower priority: {', '.join(lower)}")
    return lines


def _models(args) -> int:
    import transformers

    from ember.models.registry import supported_architectures
    print("ember's own implementations (model_impl 'ember'; 'auto' takes them where they apply):")
    for name in supported_architectures():
        print(f"  {name}")
    print(f"through transformers {transformers.__version__} (model_impl 'transformers'; 'auto' for every other "
          f"architecture): any decoder-only causal LM whose layers are softmax attention over a K/V cache and whose "
          f"class routes it through transformers' attention interface")
    if not args.transformers:
        print("  (`ember models --transformers` lists transformers' causal-LM classes with the fallback's verdict)")
        return 0
    from ember.models.fallback_check import transformers_support_table
    rows = transformers_support_table()
    runs = [name for name, _, reason in rows if reason is None]
    print(f"  {len(runs)} of {len(rows)} classes pass the checks on their default config:")
    for name in runs:
        print(f"    {name}")
    print(f"  refused ({len(rows) - len(runs)}):")
    for name, _, reason in rows:
        if reason is not None:
            print(f"    {name}: {reason}")
    return 0


def _add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or hub id (same as --model; default: the default model)")


def build_parser() -> argparse.ArgumentParser:
    from ember import __version__
    parser = argparse.ArgumentParser(prog="ember", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming to stdout",
                       formatter_class=DefaultsHelpFormatter)
    _add_model_argument(g)
    add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append")
    g.set_defaults(func=_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs `pip install ember[serve]`)",
                       formatter_class=DefaultsHelpFormatter)
    _add_model_argument(s)
    add_engine_args(s)
    s.add_argument("--config", default=None,
                   help="a bundled model config (ember/configs: qwen3-0.6b, llama-3.2-1b, llama-3.1-8b, gemma-3-1b, "
                        "qwen3-30b-a3b, mixtral-8x7b, pythia-1b) with random weights")
    s.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="'dummy' gives the model's architecture random weights")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    s.add_argument("--max-waiting", type=int, default=512,
                   help="requests allowed to wait beyond the --max-num-seqs running; more get 503 + Retry-After")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds requests in flight may run on after SIGTERM before they are aborted")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="the model's tool-call format, for tool_choice 'auto': hermes (Hermes, Qwen: "
                        "<tool_call>{json}</tool_call>) or llama3_json (Llama 3's JSON calls)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEXT",
                   help="a Jinja chat template (a file, or the template itself) to use instead of the tokenizer's")
    s.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="engine cores, each in its own process on its own GPU(s), behind this one server; each "
                        "request goes to the least-loaded one")
    s.set_defaults(func=_serve)

    b = sub.add_parser("backends", help="list registered attention backends, and what auto picks here and why")
    b.add_argument("--device", default="auto", help="the device auto picks for (default: cuda if present)")
    b.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV page (default: the engine's default for the device)")
    b.set_defaults(func=_backends)

    m = sub.add_parser("models", help="which model families run natively and which through transformers")
    m.add_argument("--transformers", action="store_true",
                   help="also judge every causal-LM class of the installed transformers (imports them all: slow)")
    m.set_defaults(func=_models)

    try:
        from ember.bench.commands import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # generate_stream aborts its request on the way out; the shell convention for SIGINT is 128 + 2
        sys.stdout.write("\n")
        print("ember: interrupted", file=sys.stderr)
        return 130
