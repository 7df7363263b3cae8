"""The KV cache's size on CUDA when device memory is held by an engine dropped in this process and not yet freed: an
engine sits in reference cycles, so only the cycle collector frees it. Sizing collects and looks again before it
settles for what is free. The device's memory calls are stubbed, so this runs without a GPU."""

import gc
import types

import pytest
import torch

from ember.runner import kv_cache_setup
from ember.runner.kv_cache_setup import GRAPH_RESERVE_BYTES, num_kv_blocks

GIB = 2**30
TOTAL = 80 * GIB
PER_BLOCK = 2**20


class _DroppedEngine:
    """Stands in for a dropped engine: a reference cycle whose finaliser gives its device memory back."""

    def __init__(self, device_memory: dict):
        self.me, self.device_memory = self, device_memory
        device_memory["free"] -= 60 * GIB

    def __del__(self):
        self.device_memory["free"] += 60 * GIB


@pytest.fixture
def device_memory(monkeypatch):
    memory = {"free": 79 * GIB}
    cuda = kv_cache_setup.torch.cuda
    monkeypatch.setattr(cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (memory["free"], TOTAL))
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    return memory


def _blocks():
    attn = types.SimpleNamespace(bytes_per_block=lambda: PER_BLOCK)
    cache = types.SimpleNamespace(num_kv_blocks=None, gpu_memory_utilization=0.9, block_size=16)
    model = torch.nn.Linear(4, 4)
    return num_kv_blocks(attn, cache, model, torch.device("cuda"), 4096, 8, 512, activation_peak=GIB)


def test_a_dropped_engine_awaiting_the_collector_is_collected_before_sizing(device_memory):
    expected = _blocks()        # nothing else on the device
    assert expected == (int(TOTAL * 0.9) - 16 * 4 - 4 * 4 - GIB - GRAPH_RESERVE_BYTES) // PER_BLOCK
    enabled = gc.isenabled()
    gc.disable()                # no automatic pass may free it first
    try:
        _DroppedEngine(device_memory)
        assert device_memory["free"] == 19 * GIB, "the stand-in was freed without the collector"
        assert _blocks() == expected
    finally:
        if enabled:
            gc.enable()


def test_memory_another_process_holds_still_bounds_the_cache(device_memory):
    device_memory["free"] = 30 * GIB      # held elsewhere: no collection gives it back
    assert _blocks() == (30 * GIB - GIB - GRAPH_RESERVE_BYTES) // PER_BLOCK
    device_memory["free"] = GIB + GRAPH_RESERVE_BYTES + PER_BLOCK     # room for one block, two needed
    with pytest.raises(ValueError, match="GiB of GPU memory is left for the KV cache"):
        _blocks()


@pytest.mark.parametrize("reserved", [0, 61 * GIB])
def test_a_cuda_start_frees_a_dropped_engine_before_its_weights_load(monkeypatch, reserved):
    """Before the weights load: a process holding device memory runs the collector (a dropped engine in a cycle goes,
    even with automatic passes off) and empties the allocator's cache; a process holding none does neither."""
    memory = {"free": TOTAL}
    emptied = []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    enabled = gc.isenabled()
    gc.disable()
    try:
        _DroppedEngine(memory)
        assert memory["free"] == TOTAL - 60 * GIB
        kv_cache_setup.free_dropped_engines(torch.device("cuda", 0))
        freed = memory["free"] == TOTAL
    finally:
        if enabled:
            gc.enable()
        gc.collect()
    assert freed == bool(reserved) and bool(emptied) == bool(reserved)
    before = len(emptied)
    kv_cache_setup.free_dropped_engines(torch.device("cpu"))
    assert len(emptied) == before, "a CPU start touched the CUDA allocator"
