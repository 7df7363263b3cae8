"""The CPU KV-cache budget: a quarter of available memory, capped at 2 GiB."""

from ember.runner.cpu_memory import CPU_KV_CACHE_MAX_BYTES, available_memory_bytes, cpu_kv_cache_bytes

GiB = 1 << 30


def test_budget_is_a_quarter_of_available_memory_up_to_the_cap():
    assert cpu_kv_cache_bytes(4 * GiB) == GiB
    assert cpu_kv_cache_bytes(64 * GiB) == CPU_KV_CACHE_MAX_BYTES == 2 * GiB
    assert cpu_kv_cache_bytes(16 << 20) == 64 << 20        # a floor when the probe reports next to nothing


def test_available_memory_is_read():
    available = available_memory_bytes()
    assert available is not None and available > 0
