"""KV capacity and throughput of a model with sliding-window layers, with its KV-cache groups (local layers keep only
their window's blocks) and forced to full attention (every layer global, `layer_types` rewritten): random weights
of a bundled config, the nano-vllm throughput workload, the same memory budget for both, one process.

    PYTHONPATH=. python benches/experiments/kv_groups_throughput.py --config gemma-3-1b [--scaled]

Forcing full attention also gives the local layers the global rope base: the model computes something else, at the
same cost per token apart from attention's span, which is what this compares.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ember import LLM
from ember.bench.commands import release_engine, run_throughput
from benches.workloads import NANO_VLLM_THROUGHPUT, SCALED_THROUGHPUT

CONFIGS = Path(__file__).resolve().parents[1] / "ember" / "configs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gemma-3-1b")
    p.add_argument("--scaled", action="store_true", help="an eighth of the nano-vllm workload")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = p.parse_args()
    config = json.loads((CONFIGS / f"{args.config}.json").read_text())
    workload = (SCALED_THROUGHPUT if args.scaled else NANO_VLLM_THROUGHPUT).build()
    rows = {}
    for variant in ("groups", "full"):
        variant_config = dict(config)
        if variant == "full":
            variant_config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
        folder = Path(tempfile.mkdtemp()) / f"{args.config}-{variant}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(variant_config))
        llm = LLM(str(folder), load_format="dummy", dtype="bfloat16",
                  gpu_memory_utilization=args.gpu_memory_utilization)
        runner = llm.engine.runner
        groups = len(runner.attn.groups)
        capacity = runner.kv_capacity_tokens
        first = run_throughput(llm, workload)
        llm.engine.kv.pool.reset_prefix_cache()
        second = run_throughput(llm, workload, warmup=False)
        rows[variant] = (groups, capacity, first, second)
        release_engine(llm)
    for variant, (groups, capacity, first, second) in rows.items():
        print(f"{args.config} {variant}: {groups} KV groups, KV cache {capacity} tokens; {len(workload.prompts)} "
              f"prompts: first run {first['output_tok_s']:.0f} output tok/s ({first['num_steps']} steps, host "
              f"{first['host_ms_per_step']:.2f} ms/step, waiting for the device "
              f"{first['device_wait_ms_per_step']:.2f} ms/step), second {second['output_tok_s']:.0f}")
    g, f = rows["groups"], rows["full"]
    print(f"capacity {g[1] / f[1]:.2f}x, throughput {g[2]['output_tok_s'] / f[2]['output_tok_s']:.2f}x (first runs), "
          f"{g[3]['output_tok_s'] / f[3]['output_tok_s']:.2f}x (second runs)")


if __name__ == "__main__":
    main()
