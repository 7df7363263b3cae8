"""How much host memory the KV cache may take when the model runs on the CPU.

On the CPU the KV cache is sized from the memory available now, less the attention's declared workspace
(docs/memory.md): a quarter of it, and never more than `CPU_KV_CACHE_MAX_BYTES`, so that a small model does not
reserve gigabytes it will not use and the rest of the machine keeps room. `num_kv_blocks=` overrides it.
"""

from __future__ import annotations

import os

CPU_KV_CACHE_FRACTION = 0.25          # of the memory available when the engine starts
CPU_KV_CACHE_MAX_BYTES = 2 << 30      # the cap: 2 GiB
CPU_KV_CACHE_MIN_BYTES = 64 << 20     # below this, available memory is misreported; take it anyway


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_kv_cache_bytes(available: int | None = None) -> int:
    """The KV-cache budget on the CPU: min(CPU_KV_CACHE_FRACTION of available memory, CPU_KV_CACHE_MAX_BYTES)."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return CPU_KV_CACHE_MAX_BYTES // 2
    return max(CPU_KV_CACHE_MIN_BYTES, min(int(available * CPU_KV_CACHE_FRACTION), CPU_KV_CACHE_MAX_BYTES))
