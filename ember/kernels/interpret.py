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
