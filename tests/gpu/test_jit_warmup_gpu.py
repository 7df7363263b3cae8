"""The start-up Triton warm-up on the GPU: after it, a throughput run in a fresh process compiles no Triton kernel;
without it, the same run compiles some (so the count can fail). Each case runs `ember bench throughput` in its own
process, because compiled kernels are cached per process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
BENCH = ["bench", "throughput", "--config", "qwen3-0.6b", "--num-prompts", "48", "--input-len", "20:1500",
         "--output-len", "8:64", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048", "--max-model-len",
         "2048", "--gpu-memory-utilization", "0.5"]


def _bench(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"bench{len(list(tmp_path.iterdir()))}.json"
    subprocess.run([sys.executable, "-m", "ember", *BENCH, *extra, "--json", str(out)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    return json.loads(out.read_text())


def test_no_triton_compile_inside_the_run_after_warmup(tmp_path):
    warm = _bench(tmp_path)
    print("warm-up on:", warm["startup"], warm["triton_compiles"], warm["triton_compiled_kernels"])
    assert warm["startup"]["warmup_s"] > 0
    assert warm["triton_compiles"] == 0, warm["triton_compiled_kernels"]
    cold = _bench(tmp_path, "--no-jit-warmup")
    print("warm-up off:", cold["startup"], cold["triton_compiles"], cold["triton_compiled_kernels"])
    assert cold["startup"]["warmup_s"] == 0
    assert cold["triton_compiles"] > 0
