"""Count Triton compilations in this process, so a benchmark can show whether any happened inside its timed run.

Two paths reach Triton's compiler. A @triton.jit kernel launched with a specialization it has not seen (ember's own
kernels) compiles inside `JITFunction.run`, which calls Triton's post-compile hook afterwards
(`triton.knobs.runtime.jit_post_compile_hook` from Triton 3.4, `JITFunction.compiled_hook` before). Inductor's
generated kernels call `triton.compile` directly. The counter chains onto the hook and wraps `triton.compile`;
Inductor's optional imitation of the hook (it passes already_compiled=True) is not counted a second time.

A compile that finds its binary in Triton's on-disk cache still counts: it is still a pause of the launching
thread, shorter but not free. Kernels run by the interpreter (TRITON_INTERPRET, CPU tensors) never compile.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["TritonCompileCounter", "process_counter"]


class TritonCompileCounter:
    """Counts Triton compilations while installed: `total`, and how many per kernel name in `kernels`."""

    def __init__(self):
        self.jit_compiles = 0          # @triton.jit kernels compiled on launch
        self.direct_compiles = 0       # triton.compile calls (Inductor's kernels)
        self.kernels: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._installed = False
        self._hook_owner = None        # (object, attribute name) of the hook slot we chained onto
        self._previous_hook = None
        self._previous_compile = None

    @property
    def total(self) -> int:
        """Compilations counted since this counter was installed."""
        return self.jit_compiles + self.direct_compiles

    @property
    def installed(self) -> bool:
        return self._installed

    def _record(self, name: str, jit: bool) -> None:
        with self._lock:
            if jit:
                self.jit_compiles += 1
            else:
                self.direct_compiles += 1
            self.kernels[name] += 1

    def _on_jit_compile(self, *args, **kwargs):
        if not kwargs.get("already_compiled", False):
            fn = kwargs.get("fn")
            self._record(str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or fn), jit=True)
        previous = self._previous_hook
        return previous(*args, **kwargs) if previous is not None else None

    def install(self) -> "TritonCompileCounter":
        """Start counting; a no-op when Triton is not installed or the counter already counts."""
        if self._installed:
            return self
        try:
            import triton
        except ImportError:
            return self
        owner = _hook_owner(triton)
        if owner is not None:
            self._hook_owner = owner
            self._previous_hook = getattr(*owner)
            setattr(*owner, self._on_jit_compile)
        compile_fn = getattr(triton, "compile", None)
        if compile_fn is not None:
            self._previous_compile = compile_fn

            def counted_compile(src, *args, **kwargs):
                result = compile_fn(src, *args, **kwargs)
                self._record(_source_name(src), jit=False)
                return result

            counted_compile.__wrapped__ = compile_fn
            triton.compile = counted_compile
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Stop counting and put back what was there (if nothing replaced it since)."""
        if not self._installed:
            return
        import triton
        if self._hook_owner is not None:
            if getattr(*self._hook_owner) == self._on_jit_compile:
                setattr(*self._hook_owner, self._previous_hook)
            self._hook_owner = self._previous_hook = None
        if self._previous_compile is not None:
            if getattr(triton.compile, "__wrapped__", None) is self._previous_compile:
                triton.compile = self._previous_compile
            self._previous_compile = None
        self._installed = False

    def __enter__(self) -> "TritonCompileCounter":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _hook_owner(triton) -> tuple[object, str] | None:
    """Where this Triton version keeps its post-compile hook."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
        return runtime, "jit_post_compile_hook"
    from triton.runtime.jit import JITFunction
    if hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "compiled_hook"
    return None


def _source_name(src) -> str:
    """A kernel name for a `triton.compile` source (an ASTSource, or a path to IR)."""
    name = getattr(src, "name", None)
    if name is None:
        name = getattr(getattr(src, "fn", None), "__name__", None)
    return str(name if name is not None else src)


_process_counter: TritonCompileCounter | None = None
_process_lock = threading.Lock()


def process_counter() -> TritonCompileCounter:
    """The process-wide counter, installed on the first call; read `total` before and after a run."""
    global _process_counter
    with _process_lock:
        if _process_counter is None:
            _process_counter = TritonCompileCounter().install()
        return _process_counter
