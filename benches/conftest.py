"""Shared benchmark helpers: the device's measured copy bandwidth and bf16 matmul rate (the rooflines results are
reported against), CUDA-event timing with inputs rotated out of L2, and a summary table printed at the end."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pytest
import torch

L2_BYTES_FALLBACK = 50 * 2**20     # H100's L2, used when the device does not report its own


@dataclass(frozen=True)
class DevicePeaks:
    """Measured, not datasheet, rates of this device in this run."""
    name: str
    copy_bytes_per_s: float        # device-to-device copy, read + write bytes counted
    bf16_flops_per_s: float        # dense bf16 matmul
    l2_bytes: int
    num_sms: int


@dataclass
class BenchTable:
    """Rows collected during the session and printed by pytest_terminal_summary."""
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row) -> None:
        self.rows.append(row)


TABLE = BenchTable()


def time_cuda(fns: Sequence[Callable[[], object]], warmup: int = 5, reps: int = 30,
              max_seconds: float = 2.0) -> float:
    """Median milliseconds of one call, each call timed alone with CUDA events, cycling through `fns` (the same
    work over different input copies, so successive calls do not find their inputs in L2)."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    probe = torch.cuda.Event(enable_timing=True)
    probe_end = torch.cuda.Event(enable_timing=True)
    probe.record()
    fns[0]()
    probe_end.record()
    torch.cuda.synchronize()
    reps = max(3, min(reps, int(max_seconds * 1000 / max(probe.elapsed_time(probe_end), 1e-3))))
    for i in range(reps):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts[:reps], ends[:reps]))


def rotation_count(bytes_per_copy: int, l2_bytes: int) -> int:
    """How many input copies to cycle through so each call's inputs were evicted from L2 by the others."""
    return 1 if bytes_per_copy >= 4 * l2_bytes else min(64, -(-4 * l2_bytes // max(bytes_per_copy, 1)))


def measure_peaks(device: torch.device) -> DevicePeaks:
    """Copy bandwidth over 1 GiB buffers and bf16 matmul rate at 8192^3, both timed with CUDA events."""
    props = torch.cuda.get_device_properties(device)
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_cuda([lambda: dst.copy_(src)], warmup=3, reps=20)
    del src, dst
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_ms = time_cuda([lambda: a @ b], warmup=5, reps=20)
    del a, b
    torch.cuda.empty_cache()
    l2 = getattr(props, "L2_cache_size", 0) or L2_BYTES_FALLBACK
    return DevicePeaks(props.name, 2 * 2**30 / (copy_ms * 1e-3), 2 * n**3 / (mm_ms * 1e-3), l2,
                       props.multi_processor_count)


@pytest.fixture(scope="session")
def device_peaks() -> DevicePeaks:
    """Measured once per session; skips when no GPU is present."""
    if not torch.cuda.is_available():
        pytest.skip("benchmarks need a CUDA device")
    peaks = measure_peaks(torch.device("cuda"))
    TABLE.notes.append(f"{peaks.name}: measured copy {peaks.copy_bytes_per_s / 1e9:.0f} GB/s, "
                       f"bf16 matmul {peaks.bf16_flops_per_s / 1e12:.0f} TFLOP/s, {peaks.num_sms} SMs")
    return peaks


@pytest.fixture(scope="session")
def bench_table() -> BenchTable:
    return TABLE


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not TABLE.rows and not TABLE.notes:
        return
    tr = terminalreporter
    tr.section("ember benchmark summary")
    for note in TABLE.notes:
        tr.write_line(note)
    groups: dict[str, list[dict]] = {}
    for row in TABLE.rows:
        groups.setdefault(row.get("suite", ""), []).append(row)
    for suite, rows in groups.items():
        columns = [c for c in rows[0] if c != "suite"]
        for row in rows[1:]:
            columns += [c for c in row if c != "suite" and c not in columns]
        cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
        widths = [max(len(c), *(len(cell[i]) for cell in cells)) for i, c in enumerate(columns)]
        tr.write_line("")
        tr.write_line(f"[{suite}]")
        tr.write_line("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for cell in cells:
            tr.write_line("  ".join(v.rjust(w) for v, w in zip(cell, widths)))
