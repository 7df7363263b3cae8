"""The residual add folded into tensor parallelism's all-reduces (ember/graphs/passes/residual_all_reduce.py), on two
real ranks over gloo: each rank traces its shard of the same model and runs the fusion pipeline. Rank 0's reduced
projections (and MoE op) take the residual, rank 1's adds go; both ranks keep exactly the unfused graph's
collectives, and every rank's output equals the unfused graph's (which all-reduces then adds). Compiled, a Qwen3
shard's pieces then hold ember ops only (the collectives and the vocab-parallel embedding among them) and run as
plain FX graphs on both ranks, as one GPU's do (ember/graphs/plain_pieces.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

RANK = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from ember.attention_backends.op import ForwardContext
    from ember.distributed.parallel_state import init_tensor_parallel, leave_tensor_parallel
    from ember.distributed.shard import ShardSpec
    from ember.models.loader import random_model
    from tests.helpers.model_harness import ModelHarness, tiny_config
    from tests.helpers.post_grad import count_calls, fused_and_reference

    store, rank, family, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, 0, "cpu", dist.FileStore(store, 2), 60.0)
    try:
        torch.manual_seed(0)
        heads = dict(num_attention_heads=4, num_key_value_heads=2) if family == "qwen3" else {}   # split in two
        model = random_model(tiny_config(family, **heads), torch.float32, shard=ShardSpec(rank, 2))
        harness = ModelHarness(model, 2)
        common, positions = harness._metadata([(0, [1, 2, 3]), (1, [4, 5])])
        ids = torch.tensor([1, 2, 3, 4, 5])
        context = ForwardContext(layers=harness.layers, attn_metadata=(harness.builder.build(common),))
        if mode == "plain":
            import pathlib
            from ember.attention_backends.op import forward_context
            from ember.graphs.compile import CompiledModel
            compiled = CompiledModel(model, cache_key=f"tp{rank}", cache_root=store + ".cache", plain_pieces=True)
            with torch.inference_mode(), forward_context(context):
                out, reference = compiled(ids, positions), model(ids, positions)
            manifest = json.loads((pathlib.Path(compiled.cache_dir) / "manifest.json").read_text())
            print(json.dumps({"plain": manifest["plain"], "folded": compiled.fusion.counts["residual_all_reduce"],
                              "error": (out - reference).abs().max().item(), "scale": reference.abs().max().item()}))
            sys.exit(0)
        pipeline, gm, out, reference = fused_and_reference(model, ids, positions, context)
    finally:
        leave_tensor_parallel()
    reduce = torch.ops.ember.all_reduce.default
    reduces = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is reduce]
    with_residual = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target) in
                     ("ember.fused_linear.default", "ember.moe.default") and len(n.args) == 7 and n.args[6] is not None
                     and any(u.target is reduce for u in n.users)]
    print(json.dumps({"folded": pipeline.counts["residual_all_reduce"], "reduces": len(reduces),
                      "adds_after_reduce": sum(u.target is torch.ops.aten.add.Tensor for n in reduces for u in n.users),
                      "reduced_with_residual": len(with_residual), "layers": model.config.num_hidden_layers,
                      "error": (out - reference).abs().max().item(), "scale": reference.abs().max().item(),
                      "out": out.flatten()[:64].tolist()}))
""")


def _ranks(family: str, tmp_path: Path, mode: str = "passes") -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "store"), str(rank), family, mode], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_each_rank_folds_the_residual_into_its_reduces_and_computes_the_same(family, tmp_path):
    rank0, rank1 = _ranks(family, tmp_path)
    layers = rank0["layers"]
    for rank in (rank0, rank1):
        assert rank["folded"] == 2 * layers                       # o and the MLP's reduce, every layer
        assert rank["reduces"] == 1 + 2 * layers                  # the embedding's, o's, the MLP's: none added
        assert rank["adds_after_reduce"] == 0
        assert rank["error"] <= 1e-5 * rank["scale"] and rank["scale"] > 0.1
    assert rank0["reduced_with_residual"] == 2 * layers and rank1["reduced_with_residual"] == 0
    assert rank0["out"] == pytest.approx(rank1["out"], rel=1e-5, abs=1e-6)   # the ranks' hidden states agree


def test_a_compiled_shards_pieces_run_as_plain_graphs_on_every_rank(tmp_path):
    for rank in _ranks("qwen3", tmp_path, "plain"):
        assert rank["plain"] and all(rank["plain"])             # no piece left to Inductor
        assert rank["folded"] == 4                                # 2 layers: o and down
        assert rank["error"] <= 1e-5 * rank["scale"] and rank["scale"] > 0.1
