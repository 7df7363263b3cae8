"""Triton's cache key of its own build (`triton.runtime.cache.triton_key`), kept on disk between processes.

Triton computes that key once a process, before its first kernel compiles or loads from its cache: it hashes its
compiler, backend and language sources and the whole `libtriton` shared library (hundreds of MB). On an H100 host
that took 0.5 s of every start-up, warm ones included. `install()` stores the key under ember's cache directory,
filed under a signature of what the key hashes (each file's path, size and modification time, found by walking
those folders), and puts a function returning it in place of Triton's where Triton and Inductor look it up. Any
change to those files changes the signature and the key is computed afresh; an unreadable entry is computed
again too. Triton's own compile-worker pools replace the key the same way; ember's (`ember.kernels.precompile`)
hand theirs the parent's key. This is the `triton_key` hook, and the dependency order below the `dependency_hashes`
hook (ember.kernels.hooks: EMBER_HOOKS turns either off).

`pin_cache_dir()` (called by `graphs.artifacts.inductor_cache_scope`) fixes where Triton keeps compiled kernels for
the whole process. Left unset, Triton's cache folder follows the TRITON_CACHE_DIR variable, which Inductor sets when
it first makes one of its kernels ready, to a folder under Inductor's own cache, and ember points that cache at a
folder per model while it compiles. A cold start then wrote ember's kernels under the model's compile folder; the
first warm start after it ended up with another folder and compiled them all again (measured on an H100: 259 cache
files written again, capture 8.0 s instead of 1.3-2.4)."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

from ember.kernels.hooks import enabled

logger = logging.getLogger("ember")

# modules that bind `triton_key` by name; each is patched only where it still holds Triton's own function
_HOLDERS = ("triton.runtime.cache", "triton.compiler.compiler", "triton.runtime.autotuner",
            "torch._inductor.runtime.triton_compat")


def build_signature(triton_dir: Path) -> str:
    """A hash of the path, size and mtime of every file `triton_key` reads (and some it does not)."""
    h = hashlib.sha256()
    roots = [triton_dir / "compiler", triton_dir / "backends", triton_dir / "language", triton_dir / "_C",
             triton_dir / "runtime"]
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".so")):
                    path = os.path.join(folder, name)
                    st = os.stat(path)
                    h.update(f"{os.path.relpath(path, triton_dir)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def install(cache_dir: Path) -> str | None:
    """Put a stored `triton_key` in place (computing and storing it when no entry matches); returns the key, or
    None when Triton is absent, the key cannot be had, or the `triton_key` hook is off (ember.kernels.hooks)."""
    if not enabled("triton_key"):
        return None
    try:
        import triton
        import triton.runtime.cache as cache
    except ImportError:
        return None
    if not callable(getattr(cache, "triton_key", None)):   # a Triton without it: nothing to keep
        return None
    if installed_key() is not None:
        return installed_key()
    try:
        signature = build_signature(Path(triton.__file__).parent)
    except OSError as exc:
        logger.debug("Triton's files could not be listed (%s); its build key is computed as usual", exc)
        return None
    path = cache_dir / "triton_key" / f"{triton.__version__}-{signature[:32]}"
    key = None
    try:
        key = path.read_text()
    except OSError:
        pass
    if not key or not key.startswith(triton.__version__):
        key = cache.triton_key()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(key)
            os.replace(tmp, path)
        except OSError as exc:
            logger.debug("Triton's build key could not be stored at %s: %s", path, exc)
    use_key(key)
    return key


def pin_cache_dir() -> str | None:
    """Set TRITON_CACHE_DIR to the folder Triton uses now (its default, or what the caller chose), so that Inductor
    leaves it alone for the rest of the process; returns the folder, or None without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    folder = str(knobs.cache.dir)
    os.environ["TRITON_CACHE_DIR"] = folder
    return folder


def pin_ptxas() -> None:
    """Set TRITON_PTXAS_PATH to the ptxas torch ships, as torch's Inductor does at the first kernel it makes ready
    (the same rule: only where the variable is unset and that file is an executable), but before this start-up's
    first Triton compile. Triton keys its cache with the ptxas version it reads at a process's first compile, so
    a start whose first compile came before Inductor's change keyed kernels otherwise than a start (or a compile
    worker, `precompile`) whose first compile came after it. Every CUDA start calls it (`runner.warmup.precompile`)."""
    if os.environ.get("TRITON_PTXAS_PATH") is not None:
        return
    import torch
    ptxas = Path(torch.__file__).resolve().parent / "bin" / "ptxas"
    if ptxas.is_file() and os.access(ptxas, os.X_OK):
        os.environ["TRITON_PTXAS_PATH"] = str(ptxas)


def order_dependency_hashes() -> bool:
    """Make the source hash Triton computes for each of ember's @triton.jit functions (`JITFunction.cache_key`, part
    of every cache key of the kernel) the same in every process, whatever that process ran before.

    Triton 3.6 merges a called function's global constants into the caller's hash before it computes that callee's
    hash, so a callee not yet hashed in this process adds nothing, and one already hashed (by an earlier kernel, or
    by compiling one) adds its constants: the same kernel got another hash after other kernels had compiled. On an
    H100 host the compile workers, a cold start and the warm start after it keyed the sampler's kernels and the
    split-KV combine three ways, and each start compiled again what another had compiled. Here the callee of one of
    ember's functions is hashed before the merge, as later Triton versions do; other functions (Inductor's, whose
    compile workers do not import this) keep Triton's order. Returns whether the order was put in place (never
    where the `dependency_hashes` hook is off: ember.kernels.hooks)."""
    if not enabled("dependency_hashes"):
        return False
    try:
        from triton.runtime.jit import DependenciesFinder
    except ImportError:
        return False
    update = getattr(DependenciesFinder, "_update_hash", None)
    if update is None or getattr(update, "ember_ordered", False):
        return update is not None

    def _update_hash(self, func):
        if str(getattr(self, "globals", {}).get("__name__", "")).startswith("ember."):
            func.cache_key        # the callee's hash and constants first, then the merge
        return update(self, func)

    _update_hash.ember_ordered = True
    DependenciesFinder._update_hash = _update_hash
    return True


def installed_key() -> str | None:
    """The key `use_key` put in place in this process, or None."""
    cache = sys.modules.get("triton.runtime.cache")
    return getattr(getattr(cache, "triton_key", None), "ember_key", None)


def use_key(key: str) -> None:
    """Have Triton (and Inductor) take `key` as Triton's build key in this process."""
    import triton.runtime.cache as cache
    current = cache.triton_key

    def stored_triton_key() -> str:
        return key

    stored_triton_key.ember_key = key
    stored_triton_key.cache_clear = lambda: None     # what callers of the lru_cache'd original may use
    for name in _HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "triton_key", None) is current:
            module.triton_key = stored_triton_key
