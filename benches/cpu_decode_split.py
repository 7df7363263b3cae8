"""A CPU decode step of ember beside transformers' in the same process, and what bounds the ratio of the two.

    python benches/cpu_decode_split.py --batch-sizes 1 8 32 --steps 20

For each batch size: ember's engine steps and transformers' forward steps (dynamic cache, greedy) alternate, one
each, so that load from other jobs on the cores falls on both; medians are printed. Beside them: the model's linear
layers alone at that many rows, through oneDNN on packed weights (ember's CPU path) and through `F.linear`
(transformers' path), on the same weights. transformers' step over ember's linear time is the ratio ember would
reach if nothing but its matrix products took time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F


def linear_times(model, rows: int, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of one pass over every linear layer and the LM head of `model` at `rows` rows:
    (oneDNN on packed weights, F.linear)."""
    from ember.models.layers.onednn import onednn_linear, pack_weight
    weights = [m.weight_to_pack() for m in model.modules() if hasattr(m, "weight_to_pack")]
    packed = [pack_weight(w) for w in weights]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    times: dict[str, list[float]] = {"onednn": [], "f_linear": []}
    for _ in range(repeats):
        start = time.perf_counter()
        for p, w in zip(packed, weights):
            onednn_linear(inputs[w.shape[1]], p)
        times["onednn"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for w in weights:
            F.linear(inputs[w.shape[1]], w)
        times["f_linear"].append(time.perf_counter() - start)
    return statistics.median(times["onednn"]), statistics.median(times["f_linear"])


@torch.inference_mode()
def compare(llm, hf_model, batch_size: int, steps: int, input_len: int) -> dict:
    """Median step times of ember and transformers, alternating, after both have prefilled the same prompts."""
    from transformers import DynamicCache

    from ember import SamplingParams
    rng = random.Random(batch_size)
    prompts = [[rng.randint(1, 30_000) for _ in range(input_len)] for _ in range(batch_size)]
    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 8)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(3):          # the prefill and two decode steps
        engine.step()
    cache = DynamicCache(config=hf_model.config)
    tokens = hf_model(torch.tensor(prompts), past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    ember_s, hf_s = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        ember_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        tokens = hf_model(tokens, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        hf_s.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    engine.step()
    return {"ember_s": statistics.median(ember_s), "hf_s": statistics.median(hf_s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--input-len", type=int, default=32)
    args = p.parse_args()
    from ember import LLM
    from ember.bench.hf_peer import _hf_model
    llm = LLM(args.model, device="cpu", dtype="float32", max_num_seqs=max(args.batch_sizes))
    runner = llm.engine.runner
    hf_model = _hf_model(runner.hf_config, torch.float32, torch.device("cpu"))
    print(f"{torch.get_num_threads()} torch threads; medians of {args.steps} alternating steps")
    for batch_size in args.batch_sizes:
        r = compare(llm, hf_model, batch_size, args.steps, args.input_len)
        onednn_s, f_linear_s = linear_times(runner.model, batch_size)
        print(f"batch {batch_size:3d}: ember {r['ember_s'] * 1e3:6.1f} ms/step, transformers {r['hf_s'] * 1e3:6.1f} "
              f"ms/step, ratio {r['hf_s'] / r['ember_s']:.2f}x | linear layers alone: oneDNN packed "
              f"{onednn_s * 1e3:6.1f} ms, F.linear {f_linear_s * 1e3:6.1f} ms | ratio if ember were its linears "
              f"only: {r['hf_s'] / onednn_s:.2f}x", flush=True)


if __name__ == "__main__":
    main()
