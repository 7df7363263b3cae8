"""Where a step's time goes: engine steps under `torch.profiler`, summarised per step.

The engine marks its phases with `record_function` ranges named "ember.*" (schedule, prepare, forward, sample,
to_host, update); this module reports their host time per step beside the device kernels' time per step, so one
table says whether a step is bound by the host (phases add up to the wall time while the device idles) or by the
device (kernel time close to the wall time), and which kernels dominate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

PHASE_PREFIX = "ember."


@dataclass
class StepProfile:
    """Per-step averages over `num_steps` profiled engine steps."""
    num_steps: int
    wall_ms: float                                    # wall time per step, profiler overhead included
    device_ms: float                                  # device kernel time per step (0 off CUDA)
    launches: float                                   # device kernels per step
    phases_ms: dict[str, float] = field(default_factory=dict)      # host time per step of each ember.* range
    kernels: list[tuple[str, float, float]] = field(default_factory=list)  # (name, calls/step, ms/step), top first
    critical_ms: dict[str, float] = field(default_factory=dict)   # each kernel's share of the critical path per step
    idle_ms: float = 0.0                              # time per step with no kernel running, within the device span

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "wall_ms": self.wall_ms, "device_ms": self.device_ms,
                "launches": self.launches, "phases_ms": self.phases_ms, "idle_ms": self.idle_ms,
                "kernels": [{"name": n, "calls": c, "ms": m, "critical_ms": self.critical_ms.get(n, 0.0)}
                            for n, c, m in self.kernels]}

    def table(self) -> str:
        """A short text table: the step, its phases, then the top kernels."""
        lines = [f"profile over {self.num_steps} steps: wall {self.wall_ms:.3f} ms/step, device kernels "
                 f"{self.device_ms:.3f} ms/step ({self.launches:.0f} launches/step), device idle "
                 f"{self.idle_ms:.3f} ms/step"]
        for name, ms in self.phases_ms.items():
            lines.append(f"  host  {name:<40s}{ms:9.3f} ms")
        if self.kernels:
            lines.append(f"  {'':6s}{'kernel':<40s}{'time':>9s}     {'calls':>6s}       {'share':>5s}  critical path")
        for name, calls, ms in self.kernels:
            share = 100.0 * ms / self.device_ms if self.device_ms else 0.0
            lines.append(f"  dev   {name[:40]:<40s}{ms:9.3f} ms  {calls:6.1f}/step  {share:5.1f}%  "
                         f"{self.critical_ms.get(name, 0.0):9.3f} ms")
        return "\n".join(lines)


def _device_time_us(evt) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(evt, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def critical_path(kernels: list[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """Charge a device timeline to its kernels: `kernels` are (name, start, end) on one device; each kernel gets the
    time from the latest end before it (or its own start, if later) to its end, and the gaps with nothing running
    go to idle. Returns ({name: time}, idle), in the inputs' unit; their sum is the span from first start to last
    end."""
    charged: dict[str, float] = {}
    idle = 0.0
    last_end = None
    for name, start, end in sorted(kernels, key=lambda k: (k[1], k[2])):
        if last_end is None:
            last_end = start
        if start > last_end:
            idle += start - last_end
            last_end = start
        charged[name] = charged.get(name, 0.0) + max(0.0, end - last_end)
        last_end = max(last_end, end)
    return charged, idle


def profile_steps(engine, num_steps: int, top: int = 15) -> StepProfile:
    """Run up to `num_steps` engine steps (requests must already be queued) under the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from ember.profiling import enabled as sections_enabled

    if num_steps < 1:
        raise ValueError(f"num_steps {num_steps} must be at least 1")
    device = engine.runner.device
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    steps = 0
    # torch's docs warn that the start of a trace costs more and skews it (its schedule's warm-up is there to be
    # discarded): a few device ops are traced and dropped first, so that the first step (a prefill) is not charged
    traced = []
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                 on_trace_ready=lambda p: traced.extend(p.events())) as prof:
        with record_function("profiler.warmup"):
            torch.ones(8, device=device).add_(1).sum().item()
        prof.step()
        with sections_enabled():
            start = time.perf_counter()
            while steps < num_steps and engine.has_unfinished():
                engine.step()
                steps += 1
            if cuda:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - start
        prof.step()
    if steps == 0:
        raise ValueError("no request was in flight to profile; add requests before profile_steps")

    # raw events, not key_averages(): with device activity on, each ember.* range also has a device-side twin of
    # the same name that the averages would merge into it
    phases: dict[str, float] = {}
    per_kernel: dict[str, list[float]] = {}
    timeline: list[tuple[str, float, float]] = []
    for evt in traced:
        if evt.device_type == DeviceType.CPU:
            if evt.name.startswith(PHASE_PREFIX):
                phases[evt.name] = phases.get(evt.name, 0.0) + evt.cpu_time_total
        elif evt.device_type == DeviceType.CUDA and not evt.name.startswith(PHASE_PREFIX):
            entry = per_kernel.setdefault(evt.name, [0, 0.0])
            entry[0] += 1
            entry[1] += _device_time_us(evt)
            span = getattr(evt, "time_range", None)
            if span is not None:
                timeline.append((evt.name, float(span.start), float(span.end)))
    phases = {name: us / 1e3 / steps for name, us in phases.items()}
    device_us = sum(us for _, us in per_kernel.values())
    launches = sum(n for n, _ in per_kernel.values())
    kernels = [(name, n / steps, us / 1e3 / steps) for name, (n, us) in per_kernel.items()]
    kernels.sort(key=lambda k: -k[2])
    critical, idle = critical_path(timeline)
    return StepProfile(steps, wall * 1e3 / steps, device_us / 1e3 / steps, launches / steps,
                       dict(sorted(phases.items(), key=lambda p: -p[1])), kernels[:top],
                       {name: us / 1e3 / steps for name, us in critical.items()}, idle / 1e3 / steps)
