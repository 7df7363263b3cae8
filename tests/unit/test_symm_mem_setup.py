"""The one-shot all-reduce's set-up in two halves: the buffer allocated on a thread of its own while the rank goes on,
the peers met in `ops.finish_setup` (a gloo group of one rank; the allocation and the CUDA-only all-reduce stand-ins:
this machine has no GPU)."""

from __future__ import annotations

import datetime
import logging
import threading

import pytest
import torch
import torch.distributed as dist

from ember.distributed import ops, symm_mem


class _OneShot:
    def __init__(self, process_group, device, buffer=None):
        self.buffer, self.device = buffer, device

    def applies(self, x):
        return True

    def __call__(self, x):
        return x * 10       # a path the test can tell from NCCL's (gloo's) sum over one rank


@pytest.fixture
def group(tmp_path, monkeypatch):
    if dist.is_initialized():
        pytest.skip("this process belongs to a process group already")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    monkeypatch.setattr(symm_mem, "OneShotAllReduce", _OneShot)
    monkeypatch.setattr(symm_mem, "one_shot_possible", lambda group, device: (True, ""))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    try:
        yield dist.group.WORLD
    finally:
        ops.unregister_group("t")
        dist.destroy_process_group()


def test_the_buffer_is_allocated_on_a_thread_and_the_one_shot_path_starts_at_finish(group, monkeypatch):
    release, threads = threading.Event(), []

    def allocate(device, *args):
        threads.append(threading.current_thread().name)
        assert release.wait(10)
        return torch.zeros(4)
    monkeypatch.setattr(symm_mem, "allocate", allocate)
    ops.register_group("t", group, torch.device("cuda", 0), symm_mem_all_reduce=True)   # returns while allocating
    x = torch.ones(3)
    assert torch.equal(ops._all_reduce_op(x, "t"), x)          # before finish_setup: the process group's sum
    release.set()
    ops.finish_setup()
    assert threads == ["ember-symm-alloc"]
    one_shot = ops._groups["t"].one_shot
    assert isinstance(one_shot, _OneShot) and torch.equal(one_shot.buffer, torch.zeros(4))
    assert torch.equal(ops._all_reduce_op(x, "t"), 10 * x)
    ops.finish_setup()                                          # a second call (another runner) changes nothing
    assert ops._groups["t"].one_shot is one_shot


def test_a_failed_allocation_leaves_nccl_or_refuses_where_the_kernel_was_asked_for(group, monkeypatch, caplog):
    def allocate(device, *args):
        raise RuntimeError("no peer mapping here")
    monkeypatch.setattr(symm_mem, "allocate", allocate)
    ops.register_group("t", group, torch.device("cuda", 0), symm_mem_all_reduce=None)
    with caplog.at_level(logging.WARNING, logger="ember"):
        ops.finish_setup()
    assert ops._groups["t"].one_shot is None
    assert "no peer mapping here" in caplog.text and "takes NCCL" in caplog.text
    ops.register_group("t", group, torch.device("cuda", 0), symm_mem_all_reduce=True)
    with pytest.raises(ValueError, match="symm_mem_all_reduce=True cannot be met: .*no peer mapping here"):
        ops.finish_setup()


def test_serial_setup_allocates_in_finish_on_the_calling_thread(group, monkeypatch):
    monkeypatch.setenv("EMBER_SYMM_MEM_SETUP", "serial")
    threads = []
    monkeypatch.setattr(symm_mem, "allocate",
                        lambda device, *a: threads.append(threading.current_thread().name) or torch.ones(2))
    ops.register_group("t", group, torch.device("cuda", 0), symm_mem_all_reduce=True)
    assert threads == []
    ops.finish_setup()
    assert threads == [threading.current_thread().name]
    assert torch.equal(ops._groups["t"].one_shot.buffer, torch.ones(2))
