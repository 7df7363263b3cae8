"""How a step's outputs travel from the engine core's process to the front end's: zmq (PUSH/PULL over an ipc://
socket, as `MPClient` does) against a shared-memory ring (a byte ring in `multiprocessing.shared_memory`, with an
eventfd to wake the reader, which an event loop needs: it cannot spin). Both carry the same msgspec encoding of
a realistic outputs message: one new token for each of N running requests (ids as the server makes them), a few
finished, the stats.

    PYTHONPATH=. python benches/experiments/core_ipc.py [--requests 256] [--messages 20000]

It prints, per transport: the round trip of one message and a small reply (latency, the reader asleep before
each); the rate of a stream of messages (throughput, sender and reader each on their own core when the machine
has two free); and the CPU time each side spends a message in the stream, which is what a transport costs the
front end's event loop and the core's step loop (wall times mean little on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import struct
import time

RING_BYTES = 1 << 22
HEADER = struct.Struct("<QQ")          # bytes written, bytes read (both only grow)
LENGTH = struct.Struct("<I")


def outputs_message(num_requests: int):
    """An `EngineCoreOutputs` as a decode step of `num_requests` requests makes it."""
    from ember.engine.core_io import CoreStats, EngineCoreOutputs
    ids = [f"3f9a6c2e81b0-{i + 1000}" for i in range(num_requests)]
    return EngineCoreOutputs(ids, [(7919 * i) % 151_000 for i in range(num_requests)],
                             {ids[0]: ("length", None, 700), ids[1]: ("stop", 151645, 312)}, {}, {}, [], None,
                             CoreStats(num_requests, 12, 9000, 40000, 123456, 812.5, 1500.25, 3, 10**6, 2 * 10**5,
                                       num_requests + 12, num_requests, 2**33, 2**34, 10**7))


class Ring:
    """A single-writer, single-reader byte ring in shared memory; an eventfd counts messages written."""

    def __init__(self, shm, efd: int):
        self.shm, self.efd = shm, efd
        self.buf = shm.buf
        self.size = len(shm.buf) - HEADER.size

    def write(self, payload: bytes) -> None:
        written, read = HEADER.unpack_from(self.buf, 0)
        need = LENGTH.size + len(payload)
        while written + need - read > self.size:       # full: wait for the reader (never happens here)
            time.sleep(0)
            written, read = HEADER.unpack_from(self.buf, 0)
        self._copy_in(written, LENGTH.pack(len(payload)))
        self._copy_in(written + LENGTH.size, payload)
        HEADER.pack_into(self.buf, 0, written + need, read)
        os.eventfd_write(self.efd, 1)

    def read_all(self) -> list[bytes]:
        """Wait for at least one message; return every message written so far."""
        os.eventfd_read(self.efd)
        written, read = HEADER.unpack_from(self.buf, 0)
        out = []
        while read < written:
            (n,) = LENGTH.unpack(self._copy_out(read, LENGTH.size))
            out.append(self._copy_out(read + LENGTH.size, n))
            read += LENGTH.size + n
        # only the reader moves `read`; the writer reads it to know the free space
        struct.pack_into("<Q", self.buf, 8, read)
        return out

    def _copy_in(self, pos: int, data: bytes) -> None:
        start = HEADER.size + pos % self.size
        first = min(len(data), HEADER.size + self.size - start)
        self.buf[start:start + first] = data[:first]
        if first < len(data):
            self.buf[HEADER.size:HEADER.size + len(data) - first] = data[first:]

    def _copy_out(self, pos: int, n: int) -> bytes:
        start = HEADER.size + pos % self.size
        first = min(n, HEADER.size + self.size - start)
        data = bytes(self.buf[start:start + first])
        if first < n:
            data += bytes(self.buf[HEADER.size:HEADER.size + n - first])
        return data


# ---- the core's side: send `count` messages, each after the reply to the last (latency) or all at once --------
def _zmq_sender(address: str, reply_address: str, payload: bytes, count: int, wait_reply: bool, cpu) -> None:
    import zmq
    context = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.connect(address)
    replies = context.socket(zmq.PULL)
    replies.bind(reply_address)
    replies.recv()                              # the reader is there
    start = time.thread_time()
    for _ in range(count):
        out.send_multipart([b"\x0b\x00\x00", payload], copy=False)
        if wait_reply:
            replies.recv()
    cpu.value = (time.thread_time() - start) / count
    replies.recv()                              # done
    out.close()
    replies.close()
    context.term()


def _ring_sender(shm_name: str, efd: int, reply_efd: int, payload: bytes, count: int, wait_reply: bool, cpu) -> None:
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(shm_name)
    ring = Ring(shm, efd)
    os.eventfd_read(reply_efd)                  # the reader is there
    start = time.thread_time()
    for _ in range(count):
        ring.write(payload)
        if wait_reply:
            os.eventfd_read(reply_efd)
    cpu.value = (time.thread_time() - start) / count
    del ring
    shm.close()


def run_zmq(payload: bytes, count: int, wait_reply: bool) -> tuple[float, float, float]:
    """Seconds per message: wall time at the reader (the front end's side, decode included), and the CPU time of
    the reader's and the sender's threads."""
    import zmq

    from ember.engine.wire import Codec
    codec = Codec()
    directory = f"/tmp/ember-ipc-bench-{os.getpid()}"
    os.makedirs(directory, exist_ok=True)
    address, reply_address = f"ipc://{directory}/out", f"ipc://{directory}/reply"
    context = zmq.Context()
    inp = context.socket(zmq.PULL)
    inp.bind(address)
    fork = multiprocessing.get_context("fork")
    cpu = fork.Value("d", 0.0)
    sender = fork.Process(target=_zmq_sender, args=(address, reply_address, payload, count, wait_reply, cpu))
    sender.start()
    replies = context.socket(zmq.PUSH)
    replies.connect(reply_address)
    replies.send(b"go")
    start, reader_cpu = time.perf_counter(), time.thread_time()
    received = 0
    while received < count:
        head, body = inp.recv_multipart()
        codec.decode_outputs(body)
        received += 1
        if wait_reply:
            replies.send(b"k")
    seconds = (time.perf_counter() - start) / count
    reader_cpu = (time.thread_time() - reader_cpu) / count
    replies.send(b"done")
    sender.join()
    inp.close()
    replies.close()
    context.term()
    return seconds, reader_cpu, cpu.value


def run_ring(payload: bytes, count: int, wait_reply: bool) -> tuple[float, float, float]:
    from multiprocessing import shared_memory

    from ember.engine.wire import Codec
    codec = Codec()
    shm = shared_memory.SharedMemory(create=True, size=RING_BYTES + HEADER.size)
    HEADER.pack_into(shm.buf, 0, 0, 0)
    efd, reply_efd = os.eventfd(0), os.eventfd(0)
    ring = Ring(shm, efd)
    fork = multiprocessing.get_context("fork")
    cpu = fork.Value("d", 0.0)
    sender = fork.Process(target=_ring_sender, args=(shm.name, efd, reply_efd, payload, count, wait_reply, cpu))
    sender.start()
    os.eventfd_write(reply_efd, 1)
    start, reader_cpu = time.perf_counter(), time.thread_time()
    received = 0
    while received < count:
        for body in ring.read_all():
            codec.decode_outputs(body)
            received += 1
            if wait_reply:
                os.eventfd_write(reply_efd, 1)
    seconds = (time.perf_counter() - start) / count
    reader_cpu = (time.thread_time() - reader_cpu) / count
    sender.join()
    del ring
    shm.close()
    shm.unlink()
    return seconds, reader_cpu, cpu.value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--messages", type=int, default=20000)
    args = p.parse_args()
    from ember.engine.wire import Codec
    codec = Codec()
    message = outputs_message(args.requests)
    payload = codec.encode_outputs(message)
    n = 2000
    start = time.thread_time()
    for _ in range(n):
        codec.encode_outputs(message)
    encode_us = (time.thread_time() - start) / n * 1e6
    start = time.thread_time()
    for _ in range(n):
        codec.decode_outputs(payload)
    decode_us = (time.thread_time() - start) / n * 1e6
    print(f"outputs of {args.requests} requests: {len(payload)} bytes; CPU to encode {encode_us:.1f} us, to decode "
          f"{decode_us:.1f} us", flush=True)
    for name, run in (("zmq ipc", run_zmq), ("shm ring", run_ring)):
        rtt, rtt_reader, rtt_sender = (x * 1e6 for x in run(payload, max(args.messages // 10, 200), wait_reply=True))
        rate, reader, sender = (x * 1e6 for x in run(payload, args.messages, wait_reply=False))
        print(f"{name:9s} round trip {rtt:7.1f} us; stream {rate:6.1f} us a message ({1e6 / rate:,.0f}/s), CPU a "
              f"message: reader {reader:.1f} us (decode included), sender {sender:.1f} us", flush=True)


if __name__ == "__main__":
    main()
