"""ember.kernels.launcher on a GPU: a launch through ember's C launcher gives the same bits as Triton's own launch,
inside a CUDA graph too; ember's key is at least as fine as the specialization Triton's binder gives on this device;
and a process with an empty Triton cache builds ember's launcher once and no per-signature launcher of Triton's for
ember's kernels."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from triton.runtime import jit

import ember.kernels.gemv as G
import ember.kernels.launcher as L
from ember.kernels.qk_norm_rope import qk_norm_rope_triton
from ember.kernels.rms_norm import rms_norm, silu_mul

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.usefixtures("gemv_unrouted")]


def _calls():
    torch.manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)
    x, w, res, nw = r(4, 1024), r(3072, 1024), r(4, 3072), r(1024)
    gu, x8 = r(6144, 1024), r(8, 1024)
    q, k = r(3, 16 * 128), r(3, 8 * 128)
    qw, kw = r(128), r(128)
    cos, sin = r(3, 64, dtype=torch.float32), r(3, 64, dtype=torch.float32)
    return {
        "gemv": lambda: G.gemv(x, w),
        "gemv_residual_split_k": lambda: G.gemv(x[:1], w[:, :], residual=res[:1]),
        "gemv_norm_gated": lambda: G.gemv(x, gu, norm_weight=nw, gated=True),
        "gemv_8_rows_dot": lambda: G.gemv(x8, w),
        "rms_norm": lambda: rms_norm(x, nw, 1e-6),
        "silu_mul": lambda: silu_mul(res),
        "qk_norm_rope": lambda: qk_norm_rope_triton(q, k, qw, kw, cos, sin, 1e-6),
    }


def _flat(out):
    return torch.cat([o.flatten().float() for o in (out if isinstance(out, tuple) else (out,))])


CALLS = ["gemv", "gemv_residual_split_k", "gemv_norm_gated", "gemv_8_rows_dot", "rms_norm", "silu_mul",
         "qk_norm_rope"]     # the names _calls() gives (made on the GPU, so not at collection)


@pytest.mark.parametrize("name", CALLS)
def test_kept_kernel_launches_equal_tritons_own_launches(name, monkeypatch):
    call = _calls()[name]
    with monkeypatch.context() as m:    # Triton's own launch, as where the fast_launch hook is off
        m.setattr(L.KernelLauncher, "_launch", lambda self, grid, *args, **kwargs: self._slow(grid, args, kwargs))
        expected = _flat(call())
    fast_before = L.fast_launch_count()
    for _ in range(3):
        got = _flat(call())
        assert torch.equal(got, expected)
    assert L.fast_launch_count() > fast_before


def test_the_call_names_are_those_made():
    assert sorted(_calls()) == sorted(CALLS)


def test_a_captured_graph_of_kept_kernel_launches_replays_their_results():
    calls = _calls()
    for call in calls.values():          # compile and keep each specialization outside the capture
        call(), call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = {name: call() for name, call in calls.items()}
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    for name, call in calls.items():
        assert torch.equal(_flat(outs[name]), _flat(call())), name


def test_equal_keys_mean_equal_specializations_on_this_device():
    fn = G._gemv_kernel
    device = torch.cuda.current_device()
    *_, binder = fn.device_caches[device]
    launch = L.KernelLauncher(fn)
    rng = random.Random(0)
    base = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    ints = [0, 1, 2, 15, 16, 17, 1024, 3072, 2 ** 31 - 16, 2 ** 31, 2 ** 40]
    seen = {}
    for _ in range(2000):
        tensors = [base[o:o + 4096].view(torch.bfloat16) for o in (rng.choice([0, 2, 8, 16, 64]) for _ in range(6))]
        scalars = [rng.choice(ints) for _ in range(8)] + [1e-6]
        scale = base[rng.choice([0, 16]):][:4096].view(torch.float32)
        scalars += [scale, rng.choice(ints)]         # the fp8 weight scales' pointer and row stride
        kwargs = dict(BLOCK_M=rng.choice([1, 2]), BLOCK_N=16, BLOCK_K=256, USE_DOT=False, ACC_3D=True, EVEN_K=True,
                      PARTIAL=rng.random() < 0.5, HAS_BIAS=False, HAS_RESIDUAL=False, NORM=False, GATED=False,
                      DOT_IN_FP32=False, IEEE_DOT=False, num_warps=4, num_stages=1)
        args = (*tensors, *scalars)
        key, _ = launch._key(device, args, kwargs)
        _, spec, options = binder(*args, **kwargs, debug=False, instrumentation_mode="")
        theirs = (tuple(spec), str(options))
        assert seen.setdefault(key, theirs) == theirs
    assert len(seen) > 50


def test_the_launchers_are_what_gemv_uses():
    assert isinstance(G._kernel(G._gemv_kernel, torch.device("cuda")), L.KernelLauncher)
    assert isinstance(G._gemv_kernel, jit.JITFunction)


def test_an_empty_triton_cache_builds_one_launcher_for_all_of_embers_kernels(tmp_path):
    script = """
import json, torch, triton.runtime.build as build
built = []
real = build._build
def spy(name, *a, **k):
    built.append(name)
    return real(name, *a, **k)
build._build = spy
import ember.kernels.gemv as G
from ember.kernels.rms_norm import rms_norm, silu_mul
import ember.kernels.launcher as L
from ember.kernels.linear_op import set_gemv_routing
set_gemv_routing(False)
x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    G.gemv(x, w); G.gemv(x[:1], w); rms_norm(x, w[0], 1e-6)
    silu_mul(torch.randn(4, 3072, device="cuda", dtype=torch.bfloat16))
torch.cuda.synchronize()
print(json.dumps([built, L.fast_launch_count()]))
"""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    built, fast = json.loads(out.stdout.strip().splitlines()[-1])
    assert "ember_launch" in built and "__triton_launcher" not in built, built
    assert fast >= 8
