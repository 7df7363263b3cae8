"""The step ring (ember.distributed.channel) with both ends in one process: messages longer than a slot, a writer
that waits for its slowest reader, and a reader that does not take a slot whose bytes are not all there yet."""

import os

import pytest

from ember.distributed.channel import RingReader, RingWriter


def test_a_ring_carries_messages_longer_than_its_slots_and_waits_for_its_readers():
    writer = RingWriter(2, num_slots=4, slot_bytes=64)
    readers = [RingReader(writer.handle, i) for i in range(2)]
    try:
        messages = [bytes([i]) * n for i, n in enumerate([0, 1, 64, 65, 150])]
        for message in messages[:2]:
            writer.send(message)
        assert [readers[0].recv() for _ in range(2)] == messages[:2]
        # reader 1 is two messages behind: the writer may fill the two slots left, and no more
        writer.send(messages[2])
        writer.send(bytes(10))
        with pytest.raises(TimeoutError, match="waited"):
            writer.send(b"one too many", check=_raise_timeout)
        assert [readers[1].recv() for _ in range(4)] == messages[:3] + [bytes(10)]
        assert [readers[0].recv() for _ in range(2)] == [messages[2], bytes(10)]
        writer.send(messages[4])      # three slots of 64 bytes
        assert readers[0].recv() == readers[1].recv() == messages[4]
    finally:
        for reader in readers:
            reader.close()
        writer.close()


def _raise_timeout():
    raise TimeoutError("waited")


def test_a_reader_does_not_take_a_slot_whose_bytes_do_not_match_their_crc():
    writer = RingWriter(1, num_slots=2, slot_bytes=16)
    reader = RingReader(writer.handle, 0)
    try:
        writer.send(b"hello")
        offset = reader._slot(1) + 64
        reader._buf[offset:offset + 1] = b"j"              # bytes not (yet) what the writer wrote
        calls = []

        def restore():
            calls.append(1)
            reader._buf[offset:offset + 1] = b"h"
        real_yield = os.sched_yield
        try:
            os.sched_yield = restore                       # the read retries (yielding) until the bytes match
            assert reader.recv() == b"hello"
        finally:
            os.sched_yield = real_yield
        assert calls == [1]
    finally:
        reader.close()
        writer.close()


def _gloo_rank(rank: int, port: int, messages: list[bytes], out) -> None:
    import datetime
    import torch.distributed as dist
    from ember.distributed.channel import GlooBroadcast
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    channel = GlooBroadcast()
    if rank == 0:
        for message in messages:
            channel.send(message)
    else:
        out.put([channel.recv() for _ in messages])
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_gloo_broadcast_carries_messages_between_two_processes():
    import multiprocessing as mp
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    messages = [b"", b"x", bytes(range(256)) * 40]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, messages, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    assert out.get(timeout=120) == messages
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
