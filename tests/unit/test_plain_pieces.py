"""Plain pieces (ember/graphs/plain_pieces.py) on the CPU: a tiny Qwen3's pieces hold only ember ops and views after
the fusion passes, so they run as their FX graphs, equal to Inductor's code; a warm start from them imports neither
dynamo nor Inductor; a piece with arithmetic left (Llama's rotary, which the CPU's attention backend does not take)
goes to Inductor; a damaged plain piece costs a recompile."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.attention_backends.op import forward_context
from ember.graphs.compile import CompiledModel
from ember.graphs.plain_pieces import fuse_final_rms_norm, plain_targets
from ember.models.layers.norm import RMSNorm
from tests.helpers.model_harness import tiny_model_step
from tests.helpers.post_grad import count_calls, post_grad_graph

ROOT = Path(__file__).resolve().parents[2]


def _run(family: str, root: Path, plain: bool):
    model, ids, positions, context = tiny_model_step(family, torch.bfloat16, seed=0)
    compiled = CompiledModel(model, cache_key=family, cache_root=root, plain_pieces=plain)
    with torch.inference_mode(), forward_context(context):
        out = compiled(ids, positions)
    return compiled, out


def _manifest(compiled: CompiledModel) -> dict:
    return json.loads((Path(compiled.cache_dir) / "manifest.json").read_text())


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # Inductor's C++ kernels may round the final norm their own way: one bf16 ulp of the largest output
    scale = b.float().abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= 2.0 ** -6 * scale


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    plain, plain_out = _run("qwen3", root, True)
    inductor, inductor_out = _run("qwen3", root, False)
    return root, plain, plain_out, inductor, inductor_out


def test_qwen3_pieces_run_as_plain_graphs_equal_to_inductors(qwen3):
    _, plain, plain_out, inductor, inductor_out = qwen3
    assert _manifest(plain)["plain"] == [True] * plain.stats.num_distinct
    assert _manifest(inductor)["plain"] == [False] * inductor.stats.num_distinct
    assert plain.cache_dir != inductor.cache_dir
    # the fusion passes' counts reach the pipeline either way
    assert plain.fusion.counts == inductor.fusion.counts and plain.fusion.counts["qk_norm_rope"] == 2
    _close(plain_out, inductor_out)


_WARM = """
import json, sys, torch
from tests.unit.test_plain_pieces import _run
compiled, out = _run("qwen3", __import__("pathlib").Path(sys.argv[1]), True)
heavy = sorted({m.split(".")[1] for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))})
torch.save(out, sys.argv[2])
print("RESULT " + json.dumps({"loaded": compiled.stats.artifacts_loaded, "heavy": heavy}))
"""


def test_a_warm_start_from_plain_pieces_imports_neither_dynamo_nor_inductor(qwen3, tmp_path):
    root, plain, plain_out, _, _ = qwen3
    done = subprocess.run([sys.executable, "-c", _WARM, str(root), str(tmp_path / "out.pt")], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads([x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert result == {"loaded": plain.stats.num_distinct, "heavy": []}
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), plain_out, rtol=0, atol=0)


def test_arithmetic_left_in_a_piece_goes_to_inductor(tmp_path):
    plain, plain_out = _run("llama", tmp_path, True)
    flags = _manifest(plain)["plain"]
    assert False in flags            # the rotary's arithmetic stays in the layers' pieces
    _, inductor_out = _run("llama", tmp_path, False)
    _close(plain_out, inductor_out)


def test_a_damaged_plain_piece_recovers_by_recompiling(qwen3, tmp_path, caplog):
    root, plain, plain_out, _, _ = qwen3
    import shutil
    entry = Path(plain.cache_dir)
    shutil.copytree(entry, tmp_path / "compile" / entry.name)
    damaged = tmp_path / "compile" / entry.name / "piece-1.bin"
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="ember"):
        rebuilt, out = _run("qwen3", tmp_path, True)
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 1      # one load tried, one warning
    assert rebuilt.stats.artifacts_loaded == 0 and rebuilt.stats.artifacts_saved == plain.stats.num_distinct
    torch.testing.assert_close(out, plain_out, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_standalone_rms_norm_becomes_one_ember_op(dtype):
    norm = RMSNorm(24, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    x = torch.randn(5, 24, dtype=dtype)
    gm = post_grad_graph(norm, x)
    want = gm(x)
    assert fuse_final_rms_norm(gm.graph) == 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert count_calls(gm, torch.ops.ember.rms_norm.default) == 1
    assert count_calls(gm, torch.ops.aten.rsqrt.default) == 0
    assert all(n.target in plain_targets() for n in gm.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


def test_a_piece_the_plain_trace_cannot_take_goes_to_inductor(tmp_path, monkeypatch, caplog):
    import ember.graphs.plain_pieces as plain_pieces

    def fail(*args, **kwargs):
        raise RuntimeError("not traceable")
    monkeypatch.setattr(plain_pieces, "plain_piece", fail)
    with caplog.at_level(logging.INFO, logger="ember"):
        compiled, out = _run("qwen3", tmp_path, True)
    assert _manifest(compiled)["plain"] == [False] * compiled.stats.num_distinct
    assert any("plain trace failed (RuntimeError: not traceable)" in r.getMessage() for r in caplog.records)
    _, plain_out = _run("qwen3", tmp_path / "again", True)
    _close(out, plain_out)
