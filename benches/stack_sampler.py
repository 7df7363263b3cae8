"""A low-overhead wall-clock profiler: a thread samples the main thread's stack every `interval_s` and counts, per
function, the samples it appears in (inclusive) and the samples it is on top of among Python frames (own).

Unlike cProfile it does not slow the code it watches (a sample costs microseconds), so its shares are shares of
the real wall time; a C call shows up as time in the Python function that made it.

    with StackSampler(0.02) as sampler:
        ...
    print(sampler.report(40))
"""

from __future__ import annotations

import collections
import sys
import threading
import time


class StackSampler:
    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.inclusive: collections.Counter = collections.Counter()
        self.own: collections.Counter = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._target = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")
        self._start = 0.0
        self.wall_s = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)
            if frame is None:
                continue
            self.samples += 1
            seen = set()
            top = True
            while frame is not None:
                code = frame.f_code
                key = f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"
                if top:
                    self.own[key] += 1
                    top = False
                if key not in seen:
                    seen.add(key)
                    self.inclusive[key] += 1
                frame = frame.f_back

    def __enter__(self) -> "StackSampler":
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.wall_s = time.perf_counter() - self._start

    def report(self, n: int = 40) -> str:
        per = self.wall_s / max(self.samples, 1)
        lines = [f"STACK SAMPLES {self.samples} over {self.wall_s:.2f} s ({per * 1e3:.1f} ms each)"]
        for title, counter in (("inclusive", self.inclusive), ("own", self.own)):
            lines.append(f"-- {title}")
            lines += [f"{c * per:8.2f} s  {key}" for key, c in counter.most_common(n)]
        return "\n".join(lines)
