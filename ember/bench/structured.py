"""`ember bench throughput --structured-output json`: the same workload unconstrained, then with every request
constrained by one JSON schema (decode steps split, then run whole: "split off", the A/B of `EMBER_GRAMMAR_SPLIT`),
then (with `--num-schemas N`) by N distinct schemas, in one process; reports each run's rate, the ratios to the
unconstrained run, the grammar compiles, the host time the bitmasks took and, on CUDA, how long the device sat idle
between the constrained steps' launches (`StreamIdle`).

With random weights the JSON is garbage, but every token is sampled under its grammar's bitmask, so the mask work
(advancing the matchers, filling the bitmasks on the host, copying and applying them on the device) is real. The
vocabulary is the tokenizer's (`--tokenizer` for a bundled config, which has none); ids past it are never allowed.
"""

from __future__ import annotations

import dataclasses

from ember.bench.workloads import Workload


def bench_schema(i: int) -> dict:
    """The i-th benchmark schema: an object with nested objects, arrays, enums and required fields; schemas of
    different i differ (in a property name and an enum), so each compiles on its own."""
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            f"title_{i}": {"type": "string"},
            "status": {"enum": ["open", "closed", f"state_{i}"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                      "required": ["name"]},
            "score": {"type": "number"},
        },
        "required": ["id", f"title_{i}", "status", "tags", "owner"],
    }


def run_structured_throughput(llm, workload: Workload, temperature: float, num_schemas: int, run) -> dict:
    """`run(llm, workload, temperature, warmup, structured)` (`commands.run_throughput`) without a grammar, with one
    schema for every request (split decode steps, then whole ones) and with `num_schemas` schemas dealt
    round-robin; the compiles each run made, and the ratios of the constrained rates to the unconstrained one."""
    from ember import SamplingParams, StructuredOutputsParams
    from ember.runner.stream_idle import StreamIdle
    engine = llm.engine
    plain = run(llm, workload, temperature, True, None)
    # build the grammar engine's vocabulary and compile the mask kernels on a schema no run uses
    warm = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=bench_schema(-1)))
    llm.generate([{"prompt_token_ids": list(range(1, 9))}], warm, use_tqdm=False)
    # a split decode step's two graphs are captured per bucket on its first use: outside the timed runs, a batch
    # that loses a row a step goes through the decode buckets (prompts shorter than a block leave no prefix cache)
    rows = engine.config.scheduler.max_num_seqs
    llm.generate([{"prompt_token_ids": [1 + i % 97] + list(range(2, 9))} for i in range(rows)],
                 [dataclasses.replace(warm, max_tokens=2 + i, ignore_eos=True) for i in range(rows)], use_tqdm=False)
    structured = engine.structured
    result = {"unconstrained": plain, "constrained": {}, "tokenizer_s": structured.compiler.tokenizer_s}
    passes = [("one_schema", 1, True), ("split_off", 1, False)]
    if num_schemas > 1:
        passes.append((f"{num_schemas}_schemas", num_schemas, True))
    for name, count, split in passes:
        engine.kv.pool.reset_prefix_cache()
        first = 0 if count == 1 else 1000      # schemas no earlier run compiled
        schemas = [StructuredOutputsParams(json=bench_schema(first + i)) for i in range(count)]
        compiler = structured.compiler
        compiled, compile_s, lanes, lanes_s = (compiler.num_compiled, compiler.compile_s, compiler.num_lanes,
                                               compiler.lanes_s)
        before = dataclasses.replace(structured.stats)
        structured.split, structured.idle = split, StreamIdle(engine.runner.device)
        try:
            figures = run(llm, workload, temperature, False, schemas)
            idle = structured.idle.take()
        finally:
            structured.split, structured.idle = True, None
        after = structured.stats
        steps = max(after.num_steps - before.num_steps, 1)
        figures.update(
            ratio=figures["output_tok_s"] / plain["output_tok_s"],
            grammars_compiled=compiler.num_compiled - compiled,
            compile_s=compiler.compile_s - compile_s,
            lanes_compiled=compiler.num_lanes - lanes,
            lanes_s=compiler.lanes_s - lanes_s,
            constrained_steps=after.num_steps - before.num_steps,
            split=split,
            split_steps=after.num_split - before.num_split,
            bitmask_before_forward_steps=after.num_before_forward - before.num_before_forward,
            gpu_idle_ms_per_step=idle[0] / steps if idle else None,
            gpu_busy_ms_per_step=idle[1] / steps if idle else None,
            rows_per_step=(after.num_rows - before.num_rows) / steps,
            wait_ms_per_step=(after.wait_s - before.wait_s) * 1e3 / steps,
            advance_ms_per_step=(after.advance_s - before.advance_s) * 1e3 / steps,
            fill_ms_per_step=(after.fill_s - before.fill_s) * 1e3 / steps)
        result["constrained"][name] = figures
    return result


def structured_rows(result: dict) -> list[tuple[str, str]]:
    """The report's lines for `run_structured_throughput`'s result."""
    plain = result["unconstrained"]
    rows = [("unconstrained", f"{plain['output_tok_s']:,.1f} output tok/s, {plain['output_tokens']:,} tokens in "
                              f"{plain['num_steps']:,} steps, {plain['host_ms_per_step']:.3f} ms/step busy")]
    for name, figures in result["constrained"].items():
        idle = ("n/a (CUDA only)" if figures["gpu_idle_ms_per_step"] is None else
                f"{figures['gpu_idle_ms_per_step']:.3f} ms idle / {figures['gpu_busy_ms_per_step']:.3f} ms busy")
        rows.append((name.replace("_", " "),
                     f"{figures['output_tok_s']:,.1f} output tok/s ({figures['ratio']:.3f}x), "
                     f"{figures['output_tokens']:,} tokens in {figures['num_steps']:,} steps; "
                     f"{figures['grammars_compiled']} grammars compiled in {figures['compile_s']:.3f} s, "
                     f"{figures['lanes_compiled']} more lanes in {figures['lanes_s']:.3f} s (thread time); per step: "
                     f"{figures['rows_per_step']:.1f} rows, wait {figures['wait_ms_per_step']:.3f} ms, advance "
                     f"{figures['advance_ms_per_step']:.3f} ms, fill {figures['fill_ms_per_step']:.3f} ms; "
                     f"GPU {idle} a step; of {figures['constrained_steps']} steps {figures['split_steps']} split, "
                     f"{figures['bitmask_before_forward_steps']} whole with the bitmask first"))
    rows.append(("vocabulary", f"converted for the grammar engine in {result['tokenizer_s']:.2f} s (once)"))
    return rows
