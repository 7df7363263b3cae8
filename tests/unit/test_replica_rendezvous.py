"""Data parallel x tensor parallel: each replica's ranks meet at a store of their own. With MASTER_PORT set, replica
i's is MASTER_PORT + i (refused at start-up, naming the ports, when one is taken); without it, each store picks a
port; one replica reads the environment as before. End to end on the CPU (about 10 s): two replicas of two gloo ranks
with MASTER_PORT set give one process's greedy tokens, their stores listening on MASTER_PORT and MASTER_PORT + 1."""

import multiprocessing
import socket
from types import SimpleNamespace

import pytest
import torch

from ember import LLM, SamplingParams
from ember.config import ParallelConfig
from ember.distributed.parallel_state import Rendezvous, _port_free, replica_rendezvous
from ember.engine import core_proc
from tests.helpers.model_harness import random_hf_model, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], list(range(40, 52)), [3, 3, 8], list(range(100, 109))]


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free on this host now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("", 0))
            base = probe.getsockname()[1]
        if base + count - 1 <= 65535 and all(_port_free(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"found no {count} consecutive free ports")


def listening(port: int) -> socket.socket:
    held = socket.socket()
    held.bind(("", port))
    held.listen()
    return held


def test_each_replica_meets_at_master_port_plus_its_index(monkeypatch):
    base = free_ports(3)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", str(base))
    assert replica_rendezvous(3) == [Rendezvous("10.1.2.3", base), Rendezvous("10.1.2.3", base + 1),
                                     Rendezvous("10.1.2.3", base + 2)]
    # no MASTER_PORT: every replica's store picks its own port
    monkeypatch.delenv("MASTER_PORT")
    monkeypatch.delenv("MASTER_ADDR")
    assert replica_rendezvous(2) == [Rendezvous("127.0.0.1", 0)] * 2


def test_a_taken_port_of_the_range_is_refused_naming_it(monkeypatch):
    base = free_ports(2)
    monkeypatch.setenv("MASTER_PORT", str(base))
    with listening(base + 1):
        with pytest.raises(ValueError, match=f"ports {base}-{base + 1}\\), and {base + 1} is in use"):
            replica_rendezvous(2)
    monkeypatch.setenv("MASTER_PORT", "65535")
    with pytest.raises(ValueError, match="65536 is past the last port"):
        replica_rendezvous(2)


def test_one_replica_or_one_rank_keeps_the_environments_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "65535")      # two replicas of it would be refused
    tp2 = SimpleNamespace(parallel=ParallelConfig(tensor_parallel_size=2))     # the part it reads of a config
    assert core_proc.replica_rendezvous(tp2, 1) == [None]
    assert core_proc.replica_rendezvous(SimpleNamespace(parallel=ParallelConfig()), 2) == [None, None]
    with pytest.raises(ValueError, match="MASTER_PORT 65535 with data_parallel_size 2"):
        core_proc.replica_rendezvous(tp2, 2)


def test_the_refusal_comes_before_any_core_starts(tmp_path, monkeypatch):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    base = free_ports(2)
    monkeypatch.setenv("MASTER_PORT", str(base))
    started = []
    monkeypatch.setattr(multiprocessing.get_context("spawn").Process, "start",
                        lambda self: started.append(self), raising=True)
    with listening(base):
        with pytest.raises(ValueError, match=f"{base} is in use on this host"):
            LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, data_parallel_size=2)
    assert started == []


def test_two_replicas_of_two_ranks_with_master_port_give_one_process_tokens(tmp_path, monkeypatch):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    random_hf_model(tiny_config("llama")).save_pretrained(tmp_path)
    one = LLM(str(tmp_path), device="cpu")
    try:
        want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        one.shutdown()
    base = free_ports(2)
    monkeypatch.setenv("MASTER_PORT", str(base))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # four ranks on the host's cores; the core processes take this count
    try:
        llm = LLM(str(tmp_path), device="cpu", tensor_parallel_size=2, data_parallel_size=2)
    finally:
        torch.set_num_threads(threads)
    try:
        assert not _port_free(base) and not _port_free(base + 1)      # each replica's store listens on its own
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        routed = list(llm.engine.client.num_routed)
    finally:
        llm.shutdown()
    assert all(len(t) == 8 for t in got)
    assert got == want
    assert routed == [2, 2]
