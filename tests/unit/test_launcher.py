"""ember.kernels.launcher: a kernel's specializations kept under ember's own key, checked against Triton's own binder
(which runs without a GPU for a named target), and launched through a stand-in for ember's C launcher with Triton's
compile stubbed out (the real launches are checked on a GPU, tests/gpu/test_launcher_gpu.py)."""

from __future__ import annotations

import random
import types

import pytest
import torch
import triton.language as tl
from triton.runtime import jit

import ember.kernels.launcher as L

_real_host_tensor_among = L._host_tensor_among


def _toy(x_ptr, y_ptr, n, m, eps, flag, B: tl.constexpr, C: tl.constexpr = 4):
    pass


def _toy_jit():
    # JITFunction directly: the decorator would give an interpreted kernel where TRITON_INTERPRET is set
    return jit.JITFunction(_toy, do_not_specialize=["m"])


class _Runtime:
    launch_enter_hook = launch_exit_hook = add_stages_inspection_hook = None
    debug = False


def _compiled(args, kwargs, scratch=0, pdl=True):
    """A stand-in for Triton's CompiledKernel of these arguments: its signature marks constexprs as Triton does
    (declared ones, ints equal to 1, None)."""
    names = ("x_ptr", "y_ptr", "n", "m", "eps", "flag", "B", "C")
    sig = {}
    for name, a in zip(names, args):
        if a is None or (type(a) is int and a == 1 and name != "m"):
            sig[name] = "constexpr"
        elif isinstance(a, torch.Tensor):
            sig[name] = "*fp16"
        elif type(a) is int:
            sig[name] = "i32" if -2 ** 31 <= a < 2 ** 31 else "i64"
        elif type(a) is bool:
            sig[name] = "u1"
        else:
            sig[name] = "fp32"
    sig.update(B="constexpr", C="constexpr")
    metadata = types.SimpleNamespace(shared=64, num_warps=kwargs.get("num_warps", 4), launch_pdl=pdl, num_ctas=1,
                                     global_scratch_size=scratch, profile_scratch_size=0)
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=sig), metadata=metadata, name="_toy",
                                 kernel=b"cubin")


def _rig(monkeypatch, fn, scratch=0, module=True):
    """A KernelLauncher over `fn` with Triton's compile, loader and ember's C launcher replaced by recorders."""
    runtime, compilation = _Runtime(), types.SimpleNamespace(instrumentation_mode="")
    loads, launches, slow, compiles = [], [], [], []
    utils = types.SimpleNamespace(load_binary=lambda *a: loads.append(a) or (11, 1000 + len(loads), 0, 0, 0))
    active = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234,
                                   utils=utils)
    monkeypatch.setattr(L, "_triton_runtime", lambda: (runtime, compilation, active))
    fake_module = types.SimpleNamespace(launch=lambda *a: launches.append(a))
    monkeypatch.setattr(L, "_launch_module", lambda: fake_module if module else None)
    monkeypatch.setattr(L, "_host_tensor_among", lambda args: False)     # the CPU tensors here stand for GPU ones

    def run(*args, grid, warmup, **kwargs):
        (compiles if warmup else slow).append((args, kwargs))
        return _compiled(args, kwargs, scratch)

    monkeypatch.setattr(fn, "run", run)
    return types.SimpleNamespace(launch=L.KernelLauncher(fn), loads=loads, launches=launches, slow=slow,
                                 compiles=compiles, runtime=runtime)


def test_a_kernel_compiles_once_per_specialization_and_launches_its_runtime_parameters(monkeypatch):
    r = _rig(monkeypatch, _toy_jit())
    x, y = torch.zeros(64, dtype=torch.float16), torch.zeros(64, dtype=torch.float32)
    first = r.launch[(3,)](x, y, 32, 5, 1e-6, 7, B=8, num_warps=4)
    second = r.launch[(3, 2)](x, y, 48, 7, 2e-6, 9, B=8, num_warps=4)       # same specialization, new values
    assert len(r.compiles) == 1 and len(r.loads) == 1 and r.slow == [] and first is second
    assert r.loads[0] == ("_toy", b"cubin", 64, 0)
    # the constexprs B and C are not kernel parameters; the null scratch pointers are
    assert r.launches == [(3, 1, 1, 4, 64, True, 1234, 1001, "ppiifipp",
                           (x.data_ptr(), y.data_ptr(), 32, 5, 1e-6, 7, None, None)),
                          (3, 2, 1, 4, 64, True, 1234, 1001, "ppiifipp",
                           (x.data_ptr(), y.data_ptr(), 48, 7, 2e-6, 9, None, None))]
    assert r.launch.fast_launches == 2


def test_an_int_specialized_to_one_is_left_out_of_the_parameters(monkeypatch):
    r = _rig(monkeypatch, _toy_jit())
    x = torch.zeros(64, dtype=torch.float16)
    r.launch[(1,)](x, x, 1, 5, 1.0, 7, B=8)
    r.launch[(1,)](x, x, 2, 5, 1.0, 7, B=8)
    assert len(r.compiles) == 2
    assert [a[8] for a in r.launches] == ["ppifipp", "ppiifipp"]
    assert r.launches[0][9] == (x.data_ptr(), x.data_ptr(), 5, 1.0, 7, None, None)


@pytest.mark.parametrize("change", ["dtype", "alignment", "one", "multiple_of_16", "int64", "constexpr",
                                    "default_constexpr", "launch_option"])
def test_a_different_specialization_compiles_again(monkeypatch, change):
    r = _rig(monkeypatch, _toy_jit())
    x = torch.zeros(64, dtype=torch.float16)
    args, kwargs = [x, x, 32, 5, 1.0, 7], dict(B=8, num_warps=4)
    r.launch[(1,)](*args, **kwargs)
    if change == "dtype":
        args[0] = torch.zeros(64, dtype=torch.bfloat16)
    elif change == "alignment":
        args[1] = x[1:]
    elif change == "one":
        args[2] = 1
    elif change == "multiple_of_16":
        args[2] = 33
    elif change == "int64":
        args[3] = 2 ** 40
    elif change == "constexpr":
        kwargs["B"] = 16
    elif change == "default_constexpr":
        kwargs["C"] = 8
    elif change == "launch_option":
        kwargs["num_warps"] = 8
    r.launch[(1,)](*args, **kwargs)
    assert len(r.compiles) == 2 and len(r.launches) == 2


def test_positional_constexprs_are_keyed_by_value(monkeypatch):
    r = _rig(monkeypatch, _toy_jit())
    x = torch.zeros(64, dtype=torch.float16)
    r.launch[(1,)](x, x, 32, 5, 1.0, 7, 16)
    r.launch[(1,)](x, x, 32, 5, 1.0, 7, 32)        # both multiples of 16: an int key would merge them
    r.launch[(1,)](x, x, 48, 5, 1.0, 7, 32)
    assert len(r.compiles) == 2 and len(r.launches) == 3


def test_tritons_own_launch_for_hooks_options_odd_arguments_and_unpacked_types(monkeypatch):
    from triton import knobs
    r = _rig(monkeypatch, _toy_jit())
    x = torch.zeros(64, dtype=torch.float16)
    args = (x, x, 32, 5, 1.0, 7)
    r.runtime.launch_enter_hook = lambda *a: None
    r.launch[(1,)](*args, B=8)
    r.runtime.launch_enter_hook = None
    if hasattr(knobs, "HookChain"):             # Triton 3.5 on: the hooks are chains, empty unless one is added
        r.runtime.launch_exit_hook = knobs.HookChain()
        r.launch[(1,)](*args, B=8)
        assert len(r.launches) == 1
        r.runtime.launch_exit_hook.add(lambda *a: None)
        r.launch[(1,)](*args, B=8)
        r.runtime.launch_exit_hook = None
    r.launch[lambda meta: (1,)](*args, B=8)                         # a callable grid
    r.launch[(1,)](*args, B=8, eps_like=3)                          # a keyword that is not a constexpr or option
    r.launch[(1,)](x, x, 32, 5, 1.0, [1], B=8)                      # a list cannot be a key
    r.launch.fn.pre_run_hooks.append(lambda *a, **k: None)
    r.launch[(1,)](*args, B=8)
    r.launch.fn.pre_run_hooks.clear()
    expected_slow = 5 + int(hasattr(knobs, "HookChain"))
    assert len(r.slow) == expected_slow and len(r.launches) == int(hasattr(knobs, "HookChain"))
    r.launch[(1,)](x, x, 32, 5, 1.0, True, B=8)                     # a u1 parameter: not packed by ember's launcher
    r.launch[(1,)](x, x, 32, 5, 1.0, True, B=8)
    assert len(r.slow) == expected_slow + 2 and len(r.compiles) == 2 and len(r.loads) == 1


def test_with_the_fast_launch_hook_off_a_kernel_is_launched_by_triton_itself(hooks_env):
    fn = _toy_jit()
    assert isinstance(L.launcher(fn), L.KernelLauncher)
    hooks_env("fast_launch=off")
    other = _toy_jit()
    assert L.launcher(other) is other


def test_scratch_memory_or_no_launcher_module_leave_the_launch_to_triton(monkeypatch):
    x = torch.zeros(64, dtype=torch.float16)
    r = _rig(monkeypatch, _toy_jit(), scratch=256)
    for _ in range(2):
        r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8)
    assert len(r.slow) == 2 and r.launches == [] and r.loads == []
    r = _rig(monkeypatch, _toy_jit(), module=False)
    r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8)
    assert len(r.slow) == 1 and r.compiles == [] and r.launches == []


def test_a_host_tensor_is_left_to_tritons_launcher_which_names_it(monkeypatch):
    r = _rig(monkeypatch, _toy_jit())
    monkeypatch.setattr(L, "_host_tensor_among", _real_host_tensor_among)
    x = torch.zeros(64, dtype=torch.float16)       # a CPU tensor
    r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8)
    assert len(r.slow) == 1 and r.launches == [] and r.compiles == []
    assert _real_host_tensor_among((1, x)) and not _real_host_tensor_among((1, None, 2.0))


def test_nothing_launches_when_the_compile_only_hook_answers(monkeypatch):
    fn = _toy_jit()
    r = _rig(monkeypatch, fn)
    monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, **k: r.compiles.append(a))      # returns None
    x = torch.zeros(64, dtype=torch.float16)
    for _ in range(2):
        assert r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8) is None
    assert len(r.compiles) == 2 and r.launches == [] and r.slow == []


def test_a_key_the_compile_only_hook_took_returns_at_once_while_that_hook_is_set(monkeypatch):
    """precompile's dry steps launch each key hundreds of times; Triton's binder and the hook's serialization ran for
    each launch. Only a hook that says it answers the same for a key is remembered, and only while it is set."""
    fn = _toy_jit()
    r = _rig(monkeypatch, fn)
    monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, **k: r.compiles.append(a))      # returns None
    x = torch.zeros(64, dtype=torch.float16)

    def dry(**kwargs):
        return True
    dry.answers_per_key = True
    r.runtime.jit_cache_hook = dry
    for _ in range(3):
        assert r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8) is None
    assert len(r.compiles) == 1
    r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=16)                   # another key asks the hook again
    assert len(r.compiles) == 2
    r.runtime.jit_cache_hook = lambda **kwargs: True             # a hook that does not say so: asked every time
    for _ in range(2):
        r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8)
    assert len(r.compiles) == 4
    import gc
    import weakref
    gone = weakref.ref(dry)
    del dry
    gc.collect()
    assert gone() is None                                        # the launcher does not keep the hook alive
    r.runtime.jit_cache_hook = None                              # the hook gone: the key compiles and launches
    monkeypatch.setattr(fn, "run", lambda *a, grid, warmup, **k: r.compiles.append(a) or _compiled(a, k))
    r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=8)
    assert len(r.compiles) == 5 and len(r.launches) == 1 and r.launches[0][7] == 1001


def test_precompiles_hook_says_it_answers_the_same_for_a_key():
    from triton import knobs

    from ember.kernels import precompile as P
    with P.compile_only(types.SimpleNamespace(submit=lambda *entry: None)):
        assert knobs.runtime.jit_cache_hook.answers_per_key is True
    assert knobs.runtime.jit_cache_hook is None


def test_keys_are_bounded(monkeypatch):
    r = _rig(monkeypatch, _toy_jit())
    monkeypatch.setattr(L, "MAX_KEYS", 3)
    x = torch.zeros(64, dtype=torch.float16)
    for b in range(5):
        r.launch[(1,)](x, x, 32, 5, 1.0, 7, B=b)
    assert len(r.launch._kept) == 3 and len(r.compiles) == 3 and len(r.slow) == 2 and len(r.launches) == 3


def test_launcher_wraps_compiled_kernels_once_and_leaves_interpreted_ones():
    from triton.runtime.interpreter import InterpretedFunction
    fn = _toy_jit()
    assert L.launcher(fn) is L.launcher(fn) and isinstance(L.launcher(fn), L.KernelLauncher)
    interpreted = InterpretedFunction(_toy)
    assert L.launcher(interpreted) is interpreted


def test_the_installed_tritons_default_knobs_leave_ember_launcher_on():
    """Triton's own defaults (its launch hooks are empty chains from 3.5 on) must not read as hooks that are set."""
    from triton import knobs
    assert not L._hooks_set(knobs.runtime, knobs.compilation)


def test_equal_keys_mean_equal_triton_specializations():
    """Whenever ember's key of two launches is the same, Triton's binder (for an sm_90 target, no GPU needed) gives
    the same specialization and options, so a kept kernel is the one Triton would have picked."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    fn = _toy_jit()
    binder = jit.create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    launch = L.KernelLauncher(fn)
    rng = random.Random(0)
    base = torch.zeros(4096, dtype=torch.uint8)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2 ** 31 - 16, 2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 16]
    seen: dict[tuple, tuple] = {}
    for _ in range(3000):
        dtype = rng.choice([torch.float16, torch.float32])
        offset = rng.choice([0, 1, 2, 4, 8, 16, 32])
        x = base[offset:offset + 64 * 4].view(dtype) if offset % 4 == 0 else base[offset:offset + 256]
        args = (x, rng.choice([x, base]), rng.choice(ints), rng.choice(ints), rng.random(), rng.random() < 0.5)
        kwargs = {"B": rng.choice([8, 16]), "num_warps": rng.choice([4, 8])}
        if rng.random() < 0.3:
            kwargs["C"] = rng.choice([4, 8])
        key, _ = launch._key(0, args, kwargs)
        _, spec, options = binder(*args, **kwargs, debug=False, instrumentation_mode="")
        triton_key = (tuple(spec), tuple(sorted(options.items())))
        assert seen.setdefault(key, triton_key) == triton_key, (args, kwargs)
    assert len(seen) > 50


def test_every_ember_kernel_is_launched_through_the_launcher_on_a_gpu_device():
    """The launch sites hand GPU tensors' launches to `launcher` and CPU tensors' to the interpreted copies."""
    from ember.attention_backends.flash.kernels import decode
    from ember.attention_backends.triton_common.interpreted import kernel_for
    from ember.attention_backends.triton_common.kv_write import kv_write_kernel
    from ember.attention_backends.triton_unified.kernels import unified_attention as unified
    from ember.kernels import gemv, prepare, sampling
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    picks = [
        (gemv._kernel(gemv._gemv_kernel, gpu), gemv._kernel(gemv._gemv_kernel, cpu)),
        (sampling._kernel("_sample_reduce_kernel", gpu), sampling._kernel("_sample_reduce_kernel", cpu)),
        (prepare._kernel(False), prepare._kernel(True)),
        (kernel_for(gpu, unified.unified_attention_kernel), kernel_for(cpu, unified.unified_attention_kernel)),
        (kernel_for(gpu, decode.flash_decode_kernel), kernel_for(cpu, decode.flash_decode_kernel)),
        (kernel_for(gpu, kv_write_kernel), kernel_for(cpu, kv_write_kernel)),
    ]
    for on_gpu, on_cpu in picks:
        assert isinstance(on_gpu, L.KernelLauncher) and isinstance(on_gpu.fn, jit.JITFunction)
        assert type(on_cpu).__name__ == "InterpretedFunction"


def test_the_launcher_source_ships_with_the_package():
    from pathlib import Path
    source = Path(L.__file__).parent / "csrc" / "launch.c"
    assert "PyInit_ember_launch" in source.read_text()
