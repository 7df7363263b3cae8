"""The start-up Triton warm-up, and the worker compiles before it, on the GPU. After the warm-up a throughput run in
a fresh process compiles no Triton kernel; without it, the same run compiles some (so the count can fail). Each
case runs in its own process, because compiled kernels are cached per process."""

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
    assert cold["startup"]["warmup_s"] == cold["startup"]["precompile_s"]    # no warm-up beyond the worker compiles
    assert cold["triton_compiles"] > 0


_CAPTURE_ENTRIES = """
import json, os, sys
from pathlib import Path
from ember import LLM, SamplingParams
from ember.runner import model_runner

cache = Path(os.environ["TRITON_CACHE_DIR"])
result = {}


def counted(phase, fn):
    def run(*args):
        before = set(cache.iterdir()) if cache.exists() else set()
        out = fn(*args)
        new = set(cache.iterdir()) - before
        result[f"{phase}_new_entries"] = len(new)
        result[f"{phase}_new_files"] = sorted(f.name for d in new for f in d.iterdir()
                                              if not f.name.startswith("__grp"))
        return out
    return run


model_runner.ModelRunner._capture = counted("capture", model_runner.ModelRunner._capture)
model_runner.run_warmup = counted("warmup", model_runner.run_warmup)
llm = LLM("qwen3-0.6b", load_format="dummy", max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024,
          gpu_memory_utilization=0.4, triton_compile_workers=int(sys.argv[1]))
result["precompile_s"] = llm.engine.runner.times.precompile_s
outputs = llm.generate([[5, 6, 7, 8 + i] for i in range(6)], SamplingParams(temperature=0.0, max_tokens=24,
                       ignore_eos=True), use_tqdm=False)
result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
print("RESULT " + json.dumps(result))
"""


def _capture_entries(tmp_path: Path, workers: int, cache_name: str) -> dict:
    """A fresh process with empty ember and Triton caches (or the ones named `cache_name` filled before)."""
    cache = tmp_path / cache_name
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EMBER_CACHE": str(cache / "ember"),
           "TRITON_CACHE_DIR": str(cache / "triton")}
    done = subprocess.run([sys.executable, "-c", _CAPTURE_ENTRIES, str(workers)], cwd=ROOT, env=env, timeout=900,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_worker_compiles_give_the_same_tokens_and_a_second_start_skips_them(tmp_path):
    """From empty caches, a start with compile workers runs the dry steps; one without does not; a second start of
    the same build skips them (its marker). The greedy tokens are the same in all three."""
    on = _capture_entries(tmp_path, 8, "on")
    off = _capture_entries(tmp_path, 0, "off")
    again = _capture_entries(tmp_path, 8, "on")
    print("workers:", {k: v for k, v in on.items() if k != "tokens"}, "none:",
          {k: v for k, v in off.items() if k != "tokens"}, "again:", {k: v for k, v in again.items() if k != "tokens"})
    assert on["precompile_s"] > 0 and off["precompile_s"] == 0 and again["precompile_s"] == 0
    assert on["tokens"] == off["tokens"] == again["tokens"]
    assert off["capture_new_entries"] > 0


def test_worker_compiles_leave_no_compile_to_the_capture_or_the_warm_up(tmp_path):
    """The worker processes compile every kernel the CUDA-graph capture and the warm-up launch, so neither writes a
    new entry to Triton's cache (a compile writes one; a load does not). The capture wrote 11 while workers keyed
    kernels with another ptxas version than the launching process (TRITON_PTXAS_PATH set by Inductor after the
    workers started), and the warm-up compiled the step sampler's kernels until the dry pass ran the sampler. One is
    left: the split-KV combine (`reduce_segments_kernel`) compiled in the capture in four of five runs on an H100
    since, for a reason not found; nothing else may."""
    on = _capture_entries(tmp_path, 8, "on")
    for phase in ("capture", "warmup"):
        print(f"new entries in the {phase}:", on[f"{phase}_new_entries"], on[f"{phase}_new_files"])
    kernels = {name.split(".")[0] for name in on["capture_new_files"] + on["warmup_new_files"]}
    assert kernels <= {"reduce_segments_kernel"}, (on["capture_new_files"], on["warmup_new_files"])
    assert on["capture_new_entries"] + on["warmup_new_entries"] <= 1, (on["capture_new_files"], on["warmup_new_files"])


_CACHE_WRITES = """
import json, os
from triton.runtime import cache as triton_cache
from ember import LLM, SamplingParams

writes = []
put = triton_cache.FileCacheManager.put


def counted(self, data, filename, binary=True):
    writes.append(filename)
    return put(self, data, filename, binary)


triton_cache.FileCacheManager.put = counted
llm = LLM("qwen3-0.6b", load_format="dummy", max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=1024,
          gpu_memory_utilization=0.4)
outputs = llm.generate([[5, 6, 7, 8 + i] for i in range(6)], SamplingParams(temperature=0.0, max_tokens=16,
                       ignore_eos=True), use_tqdm=False)
print("RESULT " + json.dumps({"writes": len(writes), "kernels": sorted({w.split(".")[0] for w in writes}),
                              "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                              "tokens": [list(o.outputs[0].token_ids) for o in outputs]}))
"""


def test_a_second_start_with_default_cache_folders_compiles_no_triton_kernel(tmp_path):
    """With TRITON_CACHE_DIR and Inductor's cache left to their defaults, a second start of the same build loads
    every Triton kernel the first one compiled: Triton's cache receives no write (a compile writes its files there; a
    load writes nothing). Unpinned, Inductor moved Triton's cache folder, and the second start compiled all of ember's
    kernels again."""
    unset = ("TRITON_CACHE_DIR", "TRITON_HOME", "TORCHINDUCTOR_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    (tmp_path / "home").mkdir()
    (tmp_path / "tmp").mkdir()
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path / "tmp"),
               EMBER_CACHE=str(tmp_path / "ember"))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _CACHE_WRITES], cwd=ROOT, env=env, timeout=900,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
        runs.append(json.loads(line[len("RESULT "):]))
    first, second = runs
    print("first start:", first["writes"], "writes,", first["triton_cache_dir"], "| second:", second["writes"],
          second["kernels"], second["triton_cache_dir"])
    assert first["writes"] > 0
    assert second["writes"] == 0, second["kernels"]
    assert first["triton_cache_dir"] == second["triton_cache_dir"] == str(tmp_path / "home" / ".triton" / "cache")
    assert first["tokens"] == second["tokens"]
