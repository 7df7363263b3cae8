"""Loading a second, interpreted copy of a Triton kernel module, for CPU tensors.

Triton decides when a @triton.jit function is decorated whether it is compiled or interpreted (TRITON_INTERPRET),
so a module's kernels are whatever the environment said at its first import. A copy executed under
`interpreter_on()` holds interpreted kernels whatever the process was started with."""

from __future__ import annotations

import contextlib
import os
import threading

_lock = threading.RLock()   # re-entrant: an interpreted import may load another module the same way


@contextlib.contextmanager
def interpreter_on():
    """TRITON_INTERPRET=1 for the duration (one thread at a time), restored afterwards."""
    with _lock:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            yield
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous


_made: dict[int, tuple[object, object]] = {}    # id(@triton.jit function) -> (it, its interpreted copy)


def interpreted(kernel):
    """`kernel` (a @triton.jit function) as Triton's interpreter runs it, for CPU tensors, whatever TRITON_INTERPRET
    said when its module was imported. The interpreter runs a copy of the Python function whose globals are its
    module's with every @triton.jit function in them interpreted the same way, so the device functions a kernel
    calls, from its own module or another, run interpreted too (a compiled one cannot be called there). One copy
    per function, kept for the process."""
    with _lock:
        return _interpreted(kernel)


def _interpreted(jit_function):
    import types

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    made = _made.get(id(jit_function))
    if made is not None:
        return made[1]
    fn = jit_function.fn
    scope = dict(fn.__globals__)
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__module__ = fn.__module__
    result = InterpretedFunction(copy)
    _made[id(jit_function)] = (jit_function, result)     # before the callees: functions may call each other
    for name, value in fn.__globals__.items():
        if isinstance(value, JITFunction):
            scope[name] = _interpreted(value)
    return result
