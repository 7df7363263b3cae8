"""Triton compiles in worker processes (ember.kernels.precompile): a specialization as Triton's jit_cache_hook
serializes it compiles in a worker to the same kernel (same hash, same cache entry) that the launching process
would compile; the hook hands ember's launches to the pool and lets others through; a bad request is reported,
not raised. Triton compiles for sm_90 on the CPU, so the workers really compile here; the dry start-up pass itself
runs on the GPU (tests/gpu/test_jit_warmup_gpu.py)."""

import inspect
import json
import types

import pytest
import triton

from ember.kernels import precompile as P
from ember.kernels import rms_norm as R

SM90 = ("cuda", 90, 32)


def _specialization(block: int = 1024, num_warps: int = 4):
    """The rms-norm kernel's specialization for bf16 rows of `block` elements, as a launch would make it: (the
    JITFunction, ASTSource arguments, parsed options, and the JSON Triton's hook hands out)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, serialize_specialization_data
    fn = JITFunction(R._rms_norm_kernel.fn)          # compiled even where TRITON_INTERPRET=1
    signature = {"x_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "K": "i32", "stride_xm": "i32",
                 "stride_om": "i32", "eps": "fp32", "BLOCK": "constexpr"}
    constexprs = {(7,): block}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    target = GPUTarget(*SM90)
    options = make_backend(target).parse_options({"num_warps": num_warps})
    args = [R._rms_norm_kernel.fn.__qualname__, signature, constexprs, attrs, options, "key"]
    if "target" in inspect.signature(serialize_specialization_data).parameters:
        args.append(target)
    return fn, (signature, constexprs, attrs), options, serialize_specialization_data(*args)


def _files(root):
    """(path, inode, mtime) of every file under `root`: Triton's cache writes a file by replacing it."""
    return sorted((str(p.relative_to(root)), p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*")
                  if p.is_file())


def test_a_worker_compiles_the_kernel_the_launch_would(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    fn, (signature, constexprs, attrs), options, spec = _specialization()
    with P.CompilePool(2, SM90) as pool:
        future = pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", spec)
        assert pool.wait() == (1, 0), pool.errors
        worker_hash = future.result()["hash"]
    entries = _files(tmp_path / "triton")
    assert any(name.endswith(".cubin") for name, _, _ in entries), entries
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    here = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*SM90),
                          options=options.__dict__)
    assert here.hash == worker_hash
    # the launching process loaded the worker's binary: a compile would have written its files anew
    assert _files(tmp_path / "triton") == entries


def test_a_worker_compiles_with_the_triton_environment_of_the_launch_not_of_its_start(tmp_path, monkeypatch):
    """Inductor sets TRITON_PTXAS_PATH after the pool has started; a worker that kept its starting environment wrote
    every kernel under another cache key (and folder), and the launching process compiled them again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "at_start"))
    monkeypatch.delenv("TRITON_DISABLE_LINE_INFO", raising=False)
    fn, (signature, constexprs, attrs), options, spec = _specialization()
    with P.CompilePool(1, SM90) as pool:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "at_launch"))
        monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")       # enters the cache key
        future = pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", spec)
        assert pool.wait() == (1, 0), pool.errors
    assert not (tmp_path / "at_start").exists()
    entries = _files(tmp_path / "at_launch")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    here = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*SM90),
                          options=options.__dict__)
    assert here.hash == future.result()["hash"]
    assert _files(tmp_path / "at_launch") == entries      # found the worker's entry: nothing compiled here


def test_a_worker_takes_exactly_the_launching_processs_triton_variables(monkeypatch):
    monkeypatch.setenv("TRITON_STALE_SETTING", "1")
    monkeypatch.setenv("EMBER_TRITON_KEY", "kept")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/usr/bin/ptxas")
    P._mirror_environment({"TRITON_PTXAS_PATH": "/opt/ptxas"})
    import os
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/ptxas"
    assert "TRITON_STALE_SETTING" not in os.environ and os.environ["EMBER_TRITON_KEY"] == "kept"
    assert P.triton_environment()["TRITON_PTXAS_PATH"] == "/opt/ptxas"


def test_specializations_that_differ_compile_to_different_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    with P.CompilePool(2, SM90) as pool:
        a = pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", _specialization(1024)[3])
        b = pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", _specialization(2048, num_warps=8)[3])
        assert pool.wait() == (2, 0), pool.errors
    assert a.result()["hash"] != b.result()["hash"]


def test_a_request_that_cannot_compile_is_reported_and_the_worker_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    spec = _specialization()[3]
    with P.CompilePool(1, SM90) as pool:
        pool.submit("ember.kernels.rms_norm", "no_such_kernel", spec)
        pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", spec)
        assert pool.wait() == (1, 1)
    assert "no_such_kernel" in pool.errors[0]


@pytest.mark.parametrize("workers", [0, -1, True, 2.0])
def test_a_pool_needs_a_worker(workers):
    with pytest.raises(ValueError, match="worker"):
        P.CompilePool(workers, SM90)


class _Pool:
    def __init__(self):
        self.submitted = []

    def submit(self, *entry):
        self.submitted.append(entry)


def _hook_call(module: str, launch_always: bool = False, spec: str = "{}"):
    jit = types.SimpleNamespace(module=module)
    if launch_always:
        P.launch_always(jit)
    return dict(key="k", repr="r", fn=types.SimpleNamespace(module=module, name="kernel", jit_function=jit),
                compile={"specialization_data": spec}, is_manual_warmup=False, already_compiled=False)


def test_compile_only_hands_over_embers_launches_once_and_restores_the_hook():
    from triton import knobs
    seen = []

    def previous(**kwargs):
        seen.append(kwargs["fn"].module)
        return None

    knobs.runtime.jit_cache_hook = previous
    pool = _Pool()
    try:
        with P.compile_only(pool) as handed:
            hook = knobs.runtime.jit_cache_hook
            assert hook(**_hook_call("ember.kernels.gemv", spec='{"a": 1}')) is True
            assert hook(**_hook_call("ember.kernels.gemv", spec='{"a": 1}')) is True      # handed over once
            assert hook(**_hook_call("ember.kernels.gemv", spec='{"a": 2}')) is True
            assert hook(**_hook_call("ember.kernels.prepare_triton", launch_always=True)) is None
            assert hook(**_hook_call("torch._inductor.generated")) is None
        assert knobs.runtime.jit_cache_hook is previous
    finally:
        knobs.runtime.jit_cache_hook = None
    assert pool.submitted == [("ember.kernels.gemv", "kernel", '{"a": 1}'), ("ember.kernels.gemv", "kernel", '{"a": 2}')]
    assert len(handed) == 2
    assert seen == ["ember.kernels.prepare_triton", "torch._inductor.generated"]


def test_kernels_whose_outputs_are_indices_launch_in_dry_steps():
    from ember.attention_backends.flash.kernels.decode import decode_plan_kernel
    from ember.kernels.prepare_triton import prepare_inputs_kernel
    assert not P._dry(prepare_inputs_kernel) and not P._dry(decode_plan_kernel)
    assert P._dry(R._rms_norm_kernel)


def test_a_worker_answers_on_stdout_only_with_answers(tmp_path):
    """The protocol line stays clean even when compiling prints."""
    import subprocess
    import sys
    spec = _specialization()[3]
    job = {"module": "ember.kernels.rms_norm", "name": "_rms_norm_kernel", "spec": spec, "target": list(SM90)}
    done = subprocess.run([sys.executable, "-m", "ember.kernels.precompile"], input=json.dumps(job) + "\n",
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "TRITON_CACHE_DIR": str(tmp_path)})
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and "hash" in json.loads(lines[0]), done.stdout + done.stderr
    # a job without the launching process's variables leaves the worker's own (its cache folder here)
    assert any(p.suffix == ".cubin" for p in tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))


@pytest.mark.parametrize("workers", [-1, True, 2.0, "4"])
def test_config_refuses_a_bad_worker_count(workers):
    from ember.config import CompileConfig, EngineConfig, ModelConfig
    config = EngineConfig(model=ModelConfig("m"), compile=CompileConfig(triton_compile_workers=workers), device="cpu")
    with pytest.raises(ValueError, match="triton_compile_workers"):
        config.resolve()


@pytest.mark.parametrize("cpus,device,expected", [(16, "cuda", 12), (13, "cuda", 12), (8, "cuda", 7), (4, "cuda", 3),
                                                  (3, "cuda", 0), (1, "cuda", 0), (16, "cpu", 0)])
def test_default_workers_follow_the_cpus_this_process_may_use(monkeypatch, cpus, device, expected):
    import os
    from ember import config as C
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert C.default_compile_workers(device) == expected
    resolved = C.EngineConfig(model=C.ModelConfig("m"), device="cpu").resolve()
    assert resolved.compile.triton_compile_workers == 0      # None resolves; off CUDA to none
    kept = C.EngineConfig(model=C.ModelConfig("m"), compile=C.CompileConfig(triton_compile_workers=5),
                          device="cpu").resolve()
    assert kept.compile.triton_compile_workers == 5


def test_the_runner_pass_does_nothing_off_cuda_or_without_workers():
    from ember.runner.warmup import precompile

    def runner(device, workers):
        config = types.SimpleNamespace(compile=types.SimpleNamespace(triton_compile_workers=workers))
        return types.SimpleNamespace(device=types.SimpleNamespace(type=device), config=config)
    assert precompile(runner("cpu", 4)) == 0.0
    assert precompile(runner("cuda", 0)) == 0.0


def test_every_cuda_start_pins_ptxas_before_it_compiles_with_workers_or_without(monkeypatch):
    """A warm start without the dry pass must key kernels as the cold start with workers did."""
    from ember.kernels import triton_key
    from ember.runner.warmup import precompile
    pinned = []
    monkeypatch.setattr(triton_key, "pin_ptxas", lambda: pinned.append("ptxas"))
    runner = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), config=types.SimpleNamespace(
        compile=types.SimpleNamespace(triton_compile_workers=0)))
    assert precompile(runner) == 0.0 and pinned == ["ptxas"]
    runner.device.type = "cpu"
    assert precompile(runner) == 0.0 and pinned == ["ptxas"]


@pytest.mark.parametrize("state", ["executable", "not executable", "missing", "variable set"])
def test_ptxas_is_pinned_to_torchs_by_inductors_rule(tmp_path, monkeypatch, state):
    import os

    import torch
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/chosen/ptxas")
    if state != "variable set":
        monkeypatch.delenv("TRITON_PTXAS_PATH")
    ptxas = tmp_path / "torch" / "bin" / "ptxas"
    if state != "missing":
        ptxas.parent.mkdir(parents=True)
        ptxas.write_text("#!/bin/sh\n")
        ptxas.chmod(0o755 if state == "executable" else 0o644)
    from ember.kernels.triton_key import pin_ptxas
    pin_ptxas()
    expected = {"executable": str(ptxas), "variable set": "/chosen/ptxas"}.get(state)
    assert os.environ.get("TRITON_PTXAS_PATH") == expected


def test_the_start_up_line_counts_worker_compiles_in_the_warm_up():
    from ember.runner.output import StartupTimes
    plain = StartupTimes(load_s=1, compile_s=2, capture_s=3, warmup_s=4).summary(12)
    assert plain.endswith("warm-up 4.0 s, other 2.0 s") and "worker" not in plain
    workers = StartupTimes(load_s=1, compile_s=2, capture_s=3, warmup_s=4, precompile_s=1.5).summary(12)
    assert "warm-up 5.5 s (of which Triton compiles in worker processes 1.5 s), other 0.5 s" in workers


BANNER = "ptxas: NVIDIA (R) Ptx optimizing assembler"


@pytest.mark.parametrize("runs, expected", [("release 12.8", True), ("release 13.0", False), (None, False)])
def test_workers_run_only_where_the_keys_name_the_ptxas_that_runs(tmp_path, monkeypatch, runs, expected):
    """Triton caches the ptxas version of its keys once a process; Inductor then points TRITON_PTXAS_PATH at
    torch's ptxas. A worker keys with the ptxas it runs, so where the two differ its entries would never be found."""
    import types as t
    from triton.backends.nvidia import compiler as nvidia
    tool = tmp_path / "ptxas"
    if runs is not None:
        tool.write_text(f"#!/bin/sh\nprintf '{BANNER}\\nCuda compilation tools, {runs}'\n")
        tool.chmod(0o755)
    monkeypatch.setattr(nvidia, "get_ptxas_version",
                        lambda arch=80: f"{BANNER}\nCuda compilation tools, release 12.8")
    monkeypatch.setattr(nvidia, "get_ptxas", lambda arch: t.SimpleNamespace(path=str(tool)))
    assert P.keys_name_current_ptxas(90) is expected


def _idle_pool(monkeypatch, script: str, workers: int = 1):
    """A pool whose worker processes run `script` instead of the compile loop."""
    import sys
    monkeypatch.setattr(P.CompilePool, "command", (sys.executable, "-c", script))
    return P.CompilePool(workers, SM90)


def test_a_hung_worker_costs_the_wait_its_time_limit_and_close_ends_it(monkeypatch):
    """A worker that never answers (a hung compile) must not hang the start-up: its compile counts as failed (the
    kernel then compiles at its launch) and `close` kills it."""
    import time
    pool = _idle_pool(monkeypatch, "import time; time.sleep(600)")
    pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", "{}")
    pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", "{}")
    t0 = time.monotonic()
    assert pool.wait(timeout=1.0) == (0, 2)
    assert time.monotonic() - t0 < 5
    assert pool.errors == ["no answer within 1 s"] * 2
    procs = list(pool._procs)
    t0 = time.monotonic()
    pool.close(grace=0.5)
    assert time.monotonic() - t0 < 10
    assert procs and all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", "{}")


def test_a_worker_that_exits_is_reported_and_no_worker_starts_after_close(monkeypatch):
    pool = _idle_pool(monkeypatch, "pass")
    pool.submit("ember.kernels.rms_norm", "_rms_norm_kernel", "{}")
    assert pool.wait(timeout=60) == (0, 1)
    assert "exited with code 0" in pool.errors[0]
    pool.close()
    started = len(pool._procs)
    with pytest.raises(RuntimeError, match="closed"):
        pool._process()          # this thread has no worker yet: it would start one, were the pool open
    assert len(pool._procs) == started


def test_the_start_up_starts_no_more_workers_than_cpus(monkeypatch, caplog):
    """`triton_compile_workers` above the CPUs the process may use is cut to them, with a warning naming it."""
    from ember.runner import warmup
    from ember.kernels import triton_key
    monkeypatch.setattr(triton_key, "pin_ptxas", lambda: None)
    monkeypatch.setattr(warmup, "usable_cpus", lambda: 3)
    monkeypatch.setattr(warmup, "_marker", lambda runner: __import__("pathlib").Path("/nonexistent/marker"))
    monkeypatch.setattr(P, "current_target", lambda: ("cpu", 0, 1))
    started = []

    class Stop(Exception):
        pass

    def pool(workers, target):
        started.append(workers)
        raise Stop
    monkeypatch.setattr(P, "CompilePool", pool)
    monkeypatch.setattr(warmup, "_dry_steps", lambda runner: [])
    compile_config = types.SimpleNamespace(triton_compile_workers=64)
    runner = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"), compile_stats=None,
                                   tp=types.SimpleNamespace(size=1), config=types.SimpleNamespace(compile=compile_config))
    with caplog.at_level("WARNING", logger="ember"), pytest.raises(Stop):
        warmup.precompile(runner)
    assert started == [3]
    assert "triton_compile_workers 64 is more than the 3 CPUs" in caplog.text
