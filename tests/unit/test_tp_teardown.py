"""Leaving a tensor-parallel group never hangs the process: the communicators' teardown runs in a thread given a
bounded time, and at shutdown rank 0 starts its teardown together with the workers' (NCCL's waits for peers), not
after they exit. The NCCL calls are stood in for: what is checked is ember's order and its bound."""

import logging
import threading
import time

import torch
import torch.distributed as dist

from ember.distributed import parallel_state
from ember.executor import multiproc
from ember.graphs.cuda_graph import CUDAGraphManager, _Entry
from ember.graphs.modes import BatchDescriptor


def _join_teardowns() -> None:
    """Wait for the teardown threads a test left stuck and then freed: one still running would call the next test's
    patched functions."""
    for thread in threading.enumerate():
        if thread.name == "ember-tp-teardown":
            thread.join(timeout=5.0)


def test_a_teardown_that_never_returns_is_left_to_the_exit(monkeypatch, caplog):
    release = threading.Event()
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda: (calls.append("abort"), release.wait()))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ember"):
        finished = parallel_state.leave_tensor_parallel(wait_s=0.3)
    took = time.monotonic() - start
    release.set()
    _join_teardowns()
    assert finished is False and 0.3 <= took < 5.0
    assert calls[0] == "abort"
    assert "did not finish" in caplog.text
    assert parallel_state.tensor_parallel().size == 1      # ember's side is gone whatever NCCL does


def test_a_release_that_never_returns_is_bounded_like_the_teardown(monkeypatch):
    stuck, calls = threading.Event(), []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda: "gloo")
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    start = time.monotonic()
    finished = parallel_state.leave_tensor_parallel(wait_s=0.3, release=lambda: (calls.append("release"),
                                                                                  stuck.wait()))
    took = time.monotonic() - start
    stuck.set()
    _join_teardowns()
    assert finished is False and 0.3 <= took < 5.0
    assert calls[0] == "release"


def test_a_teardown_that_returns_reports_it(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: not calls or calls[-1] != "destroy")
    monkeypatch.setattr(dist, "get_backend_config", lambda: "gloo")
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    assert parallel_state.leave_tensor_parallel(wait_s=5.0) is True
    assert calls == ["destroy"]                             # gloo: no abort, the group destroyed


class _Process:
    def __init__(self, events):
        self.events = events

    def wait(self, timeout=None):
        self.events.append("worker exit awaited")
        return 0

    def kill(self):
        self.events.append("worker killed")


class _Ring:
    def __init__(self, events, fail=False):
        self.events, self.fail = events, fail

    def send(self, data, check):
        if self.fail:
            raise OSError("the ring is closed")
        self.events.append("shutdown sent")

    def close(self):
        pass


class _Status:
    def close(self):
        pass


def _shutdown_order(monkeypatch, ring_fails: bool) -> list[str]:
    events: list[str] = []
    def leave(release=None):
        if release is not None:
            release()
        events.append("group left")

    monkeypatch.setattr(multiproc, "leave_tensor_parallel", leave)
    worker = multiproc._Worker(rank=1, process=_Process(events), status=_Status())
    shared = multiproc._Shared(workers=[worker], ring=_Ring(events, ring_fails), timeout_s=1.0,
                               release_graphs=lambda: events.append("graphs released"))
    multiproc._shutdown(shared)
    multiproc._shutdown(shared)                             # idempotent
    return events


def test_rank_zero_leaves_with_the_workers_at_shutdown(monkeypatch):
    assert _shutdown_order(monkeypatch, ring_fails=False) == ["shutdown sent", "graphs released", "group left",
                                                                     "worker exit awaited"]


def test_rank_zero_leaves_after_the_workers_when_they_cannot_be_told(monkeypatch):
    # no wait on the device: a graph's collective may be stuck on a rank that is gone
    assert _shutdown_order(monkeypatch, ring_fails=True) == ["worker exit awaited", "group left"]


class _Graph:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


def test_releasing_graphs_resets_each_one_and_forgets_its_descriptor():
    manager = CUDAGraphManager("cpu")
    full, piece = manager.wrap_full(lambda x: x), manager.wrap_piece(lambda x: x, "piece_0")
    graphs = [_Graph() for _ in range(3)]
    full.entries[BatchDescriptor(8, uniform_decode=True)] = _Entry(graphs[0], None, None)
    piece.entries[BatchDescriptor(8, uniform_decode=True)] = _Entry(graphs[1], None, None)
    piece.entries[BatchDescriptor(16, uniform_decode=False)] = _Entry(graphs[2], None, None)
    assert manager.release() == 3
    assert [g.resets for g in graphs] == [1, 1, 1]
    assert not full.entries and not piece.entries
    assert manager.release() == 0


def test_a_group_name_set_up_before_in_this_process_takes_nccl(tmp_path, monkeypatch):
    """torch keeps a group name's symmetric-memory set-up (its store) for the process's life: a later group of the
    same name must not meet at the old store, so no rank takes the one-shot kernel."""
    import torch

    from ember.distributed import symm_mem
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        monkeypatch.setattr(symm_mem, "_rendezvoused", set())
        assert symm_mem.one_shot_possible(group, torch.device("cuda", 0)) == (True, "")
        symm_mem._rendezvoused.add(group.group_name)
        possible, reason = symm_mem.one_shot_possible(group, torch.device("cuda", 0))
        assert possible is False and "earlier group of the same name" in reason
    finally:
        dist.destroy_process_group()


def test_the_peer_to_peer_backend_is_named_only_where_none_is_chosen():
    # torch registers the CUDA allocator as the device's default, not by name: naming it again is refused, so a
    # device whose backend answers "CUDA" (or another one chosen before) is left as it is
    import types
    from ember.distributed.symm_mem import _use_peer_to_peer_backend
    for current, named in ((None, ["CUDA"]), ("CUDA", []), ("NVSHMEM", [])):
        calls = []
        fake = types.SimpleNamespace(get_backend=lambda device, c=current: c, set_backend=calls.append)
        _use_peer_to_peer_backend(fake, torch.device("cuda", 0))
        assert calls == named, (current, calls)
