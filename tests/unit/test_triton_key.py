"""Triton's build key kept on disk (ember.kernels.triton_key): the stored key is Triton's own, a second process
reads it instead of hashing Triton, and a changed Triton or a damaged entry computes it again."""

import sys

import pytest

triton = pytest.importorskip("triton")
import triton.runtime.cache as cache  # noqa: E402

from ember.kernels import triton_key as tk  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    """Triton's own key function, counting its calls, in every module that holds it (restored afterwards)."""
    real = cache.triton_key
    calls = []

    def counted():
        calls.append(1)
        return real()

    for name in tk._HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "triton_key", None) is real:
            monkeypatch.setattr(module, "triton_key", counted)
    return real, calls, counted


def test_stored_key_is_tritons_and_a_second_process_reads_it(tmp_path, fresh, monkeypatch):
    real, calls, counted = fresh
    key = tk.install(tmp_path)
    assert key == real() and cache.triton_key() == key and tk.installed_key() == key
    assert len(calls) == 1
    assert len(list((tmp_path / "triton_key").iterdir())) == 1
    monkeypatch.setattr(cache, "triton_key", counted)      # a new process: Triton's function in place again
    assert tk.install(tmp_path) == key
    assert len(calls) == 1                                 # read from disk, not hashed again
    assert cache.triton_key() == key


def test_changed_triton_or_damaged_entry_computes_again(tmp_path, fresh, monkeypatch):
    real, calls, counted = fresh
    key = tk.install(tmp_path)
    entry, = (tmp_path / "triton_key").iterdir()
    entry.write_text("garbage")                            # not a key of this Triton
    monkeypatch.setattr(cache, "triton_key", counted)
    assert tk.install(tmp_path) == key and len(calls) == 2
    assert entry.read_text() == key                        # and repaired
    monkeypatch.setattr(cache, "triton_key", counted)
    monkeypatch.setattr(tk, "build_signature", lambda d: "0" * 64)   # a file of Triton changed
    assert tk.install(tmp_path) == key and len(calls) == 3
    assert len(list((tmp_path / "triton_key").iterdir())) == 2


def test_signature_follows_file_changes(tmp_path):
    root = tmp_path / "triton"
    (root / "compiler").mkdir(parents=True)
    f = root / "compiler" / "code.py"
    f.write_text("a = 1\n")
    first = tk.build_signature(root)
    assert tk.build_signature(root) == first
    f.write_text("a = 22\n")
    assert tk.build_signature(root) != first


def test_pinned_cache_dir_is_tritons_and_inductor_keeps_it(tmp_path, monkeypatch):
    """Unset, TRITON_CACHE_DIR is pinned to Triton's default folder, which Inductor then reads instead of choosing a
    folder under its own cache; a folder the caller set stays."""
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from triton import knobs
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert triton_cache_dir(0) == str(tmp_path / "inductor" / "triton" / "0")     # what Inductor picks unpinned
    folder = tk.pin_cache_dir()
    assert folder == str(tmp_path / "home" / ".triton" / "cache")
    assert knobs.cache.dir == folder and triton_cache_dir(0) == folder
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert tk.pin_cache_dir() == str(tmp_path / "mine") and triton_cache_dir(0) == str(tmp_path / "mine")


def _reset(module):
    """Forget every source hash of the @triton.jit functions of `module`: a process that has hashed none yet."""
    from triton.runtime.jit import JITFunction
    for value in vars(module).values():
        if isinstance(value, JITFunction):
            value.hash, value.used_global_vals = None, {}


def test_ember_kernel_hashes_do_not_depend_on_what_this_process_hashed_before(monkeypatch):
    """Triton 3.6 merged a callee's global constants into its caller's hash before hashing the callee: the sampler's
    kernel hashed fresh differed from the same kernel hashed once its callees had been (after other kernels, or a
    compile), so processes keyed it differently. With ember's order the two agree."""
    from triton.runtime import jit as J
    from ember.kernels import sampling, triton_key

    def merge_then_hash(self, func):       # Triton 3.6's order
        self.used_global_vals.update(func.used_global_vals)
        self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode("utf-8"))

    def fresh_then_again():
        _reset(sampling)
        fresh = sampling._sample_partial_kernel.cache_key
        sampling._sample_partial_kernel.hash = None       # its callees stay hashed
        return fresh, sampling._sample_partial_kernel.cache_key

    monkeypatch.setattr(J.DependenciesFinder, "_update_hash", merge_then_hash)
    fresh, again = fresh_then_again()
    assert fresh != again          # the order this guards against does make them differ
    assert triton_key.order_dependency_hashes()
    assert J.DependenciesFinder._update_hash.ember_ordered
    fresh, again = fresh_then_again()
    assert fresh == again
    _reset(sampling)
