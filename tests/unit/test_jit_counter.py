"""The Triton compile counter. No kernel compiles on a CPU-only machine (the interpreter never calls the compiler),
so these tests drive the two paths the counter watches by hand: Triton's post-compile hook, as JITFunction calls
it after a compile, and `triton.compile`, as Inductor calls it (replaced here by a stand-in)."""

from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")

from ember.kernels.jit_counter import TritonCompileCounter, _hook_owner  # noqa: E402


def _fire_hook(name: str, already_compiled: bool = False):
    owner = _hook_owner(triton)
    hook = getattr(*owner)
    return hook(key="k", repr=name, fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                already_compiled=already_compiled)


@pytest.fixture
def fake_compile(monkeypatch):
    calls = []

    def compile_stub(src, target=None, options=None):
        calls.append(src)
        return f"binary of {src.name}"

    monkeypatch.setattr(triton, "compile", compile_stub)
    return calls


def test_counts_jit_compiles_and_chains_the_previous_hook(monkeypatch):
    owner = _hook_owner(triton)
    seen = []
    monkeypatch.setattr(*owner, lambda **kw: seen.append(kw["fn"].name))
    with TritonCompileCounter() as counter:
        _fire_hook("kernel_a")
        _fire_hook("kernel_a")
        _fire_hook("kernel_b")
        # Inductor's imitation of the hook after its own triton.compile call: already counted there
        _fire_hook("inductor_kernel", already_compiled=True)
        assert counter.jit_compiles == 3
        assert counter.total == 3
        assert counter.kernels == {"kernel_a": 2, "kernel_b": 1}
    assert seen == ["kernel_a", "kernel_a", "kernel_b", "inductor_kernel"]
    # uninstalled: the previous hook is back and nothing more is counted
    _fire_hook("kernel_c")
    assert counter.total == 3
    assert seen[-1] == "kernel_c"


def test_counts_direct_triton_compile(fake_compile):
    stub = triton.compile
    with TritonCompileCounter() as counter:
        out = triton.compile(SimpleNamespace(name="triton_poi_fused_add_0"), target=None, options={})
        assert out == "binary of triton_poi_fused_add_0"
        assert counter.direct_compiles == 1 and counter.jit_compiles == 0
        assert counter.kernels == {"triton_poi_fused_add_0": 1}
    assert triton.compile is stub
    assert len(fake_compile) == 1


def test_install_is_idempotent_and_uninstall_restores(fake_compile):
    owner = _hook_owner(triton)
    hook_before, compile_before = getattr(*owner), triton.compile
    counter = TritonCompileCounter().install().install()
    _fire_hook("k")
    assert counter.total == 1         # chained once, so counted once
    counter.uninstall()
    counter.uninstall()
    assert getattr(*owner) is hook_before
    assert triton.compile is compile_before
