"""The real SmolLM2-135M-Instruct on the GPU: greedy parity with transformers (float32) and the nano-vllm
throughput workload through `LLM.generate` with text outputs.

    python benches/real_model.py /path/to/SmolLM2-135M-Instruct [--dtype bfloat16] [--num-prompts 256]
"""

from __future__ import annotations

import argparse
import json
import time


VARIANTS = {
    "default": {},
    "eager": {"enforce_eager": True},
    "no_fusion": {"disabled_fusions": ["all"]},
    "sync": {"async_scheduling": False},
    "torch_ref_eager": {"enforce_eager": True, "attention_backend": "torch_ref"},
}


def greedy_parity(path: str, prompts: list[str], max_tokens: int, variants: dict[str, dict]) -> dict:
    """ember's and transformers' greedy tokens on the same chat prompts, float32, on the GPU; one ember engine per
    variant (a name and its `LLM(...)` keyword arguments)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ember import LLM, SamplingParams
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
           for p in prompts]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf_tokens = []
    for prompt in ids:
        # a plain argmax loop: generate() would apply the folder's generation_config (penalties and the like)
        seq = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            for _ in range(max_tokens):
                nxt = hf(seq).logits[0, -1].argmax()
                seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
        hf_tokens.append(seq[0, len(prompt):].tolist())
    del hf
    torch.cuda.empty_cache()
    from ember.bench.commands import release_engine
    report = {"prompts": len(prompts)}
    for name, kwargs in variants.items():
        llm = LLM(path, dtype="float32", **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        ember_tokens = [o.outputs[0].token_ids for o in outs]
        report[name] = {"equal": sum(a == b for a, b in zip(ember_tokens, hf_tokens)),
                        "first_diff": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                       for a, b in zip(ember_tokens, hf_tokens)],
                        "text": outs[0].outputs[0].text[:60]}
        print("parity", name, report[name], flush=True)
        release_engine(llm)
    return report



def text_throughput(path: str, dtype: str, num_prompts: int, runs: int) -> list[dict]:
    """nano-vllm's workload (random token prompts, in/out U[100, 1024]) through `LLM.generate`, outputs detokenized;
    the first run in the fresh engine first."""
    from ember import LLM, SamplingParams
    from ember.bench.workloads import random_workload
    llm = LLM(path, dtype=dtype)
    vocab = llm.engine.runner.hf_config.vocab_size
    work = random_workload(num_prompts, (100, 1024), (100, 1024), seed=0, max_token_id=min(vocab - 1, 10000))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in work.output_lens]
    results = []
    for _ in range(runs):
        stats = llm.engine.stats
        steps0, host0 = stats.num_steps, stats.host_s
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        chars = sum(len(o.outputs[0].text) for o in outs)
        steps = stats.num_steps - steps0
        results.append({"output_tokens": produced, "text_chars": chars, "elapsed_s": round(elapsed, 3),
                        "output_tok_s": round(produced / elapsed), "steps": steps,
                        "host_ms_per_step": round((stats.host_s - host0) * 1e3 / max(steps, 1), 3)})
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--parity-tokens", type=int, default=48)
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--variants", nargs="+", default=["default"], choices=sorted(VARIANTS))
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    report = {}
    if not args.skip_parity:
        report["parity_fp32"] = greedy_parity(args.path, ["What is the capital of France?", "Write a haiku about rain.",
                                                          "List three prime numbers.", "Explain gravity briefly."],
                                              args.parity_tokens, {v: VARIANTS[v] for v in args.variants})
    if args.skip_throughput:
        return
    report["throughput"] = text_throughput(args.path, args.dtype, args.num_prompts, args.runs)
    for i, r in enumerate(report["throughput"]):
        print(f"run {i + 1} ({'first' if i == 0 else 'again'}): {json.dumps(r)}", flush=True)


if __name__ == "__main__":
    main()
