"""How fast a step's message reaches the other tensor-parallel ranks: encoding a `StepInput` (pickle against
msgspec), and one message's bytes' trip from rank 0 to rank 1 through each channel a step could take (ember's
shared-memory ring, pyzmq PUSH/PULL over ipc, a gloo broadcast), as half a round trip (the reply is a few bytes by
the same kind of channel), median over many.

    PYTHONPATH=. python benches/step_channel.py [--iters 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time

from ember.runner.step_input import NewRequest, RunningRequest, StepInput
from ember.sampling_params import SamplingParams


def decode_step(num_reqs: int) -> StepInput:
    """A decode step of `num_reqs` running requests, one in sixteen of which gained a block."""
    ids = tuple(str(1000 + i) for i in range(num_reqs))
    grown = tuple(RunningRequest(r, ((7 + i,),)) for i, r in enumerate(ids[::16]))
    return StepInput(running_requests=grown, req_ids=ids, num_scheduled_tokens=(1,) * num_reqs,
                     num_decodes=num_reqs, num_computed_tokens=tuple(100 + i for i in range(num_reqs)))


def prefill_step(prompt_len: int) -> StepInput:
    """One new request of `prompt_len` prompt tokens, prefilled whole."""
    new = NewRequest("42", tuple(range(1000, 1000 + prompt_len)), SamplingParams(temperature=0.7, max_tokens=128),
                     1234, (tuple(range(1, prompt_len // 16 + 2)),), 0, (), (2,))
    return StepInput(new_requests=(new,), req_ids=("42",), num_scheduled_tokens=(prompt_len,), num_decodes=0,
                     num_computed_tokens=(0,))


def _median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def encoding(iters: int) -> None:
    try:
        import msgspec
    except ImportError:
        msgspec = None
    for label, step in [("decode 1", decode_step(1)), ("decode 64", decode_step(64)),
                        ("decode 256", decode_step(256)), ("prefill 2048", prefill_step(2048))]:
        blob = pickle.dumps(step, protocol=5)
        dumps_us = _median_us(lambda: pickle.dumps(step, protocol=5), iters)
        line = (f"encode {label}: pickle {len(blob)} B, dumps {dumps_us:.1f} us, loads "
                f"{_median_us(lambda: pickle.loads(blob), iters):.1f} us")
        if msgspec is not None:
            # SamplingParams' `stop` (tuple | list | str | None) has no typed msgspec decoding: decode to builtins
            enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
            packed = enc.encode(step)
            line += (f"; msgspec {len(packed)} B, encode {_median_us(lambda: enc.encode(step), iters):.1f} us, "
                     f"decode to builtins {_median_us(lambda: dec.decode(packed), iters):.1f} us")
        print(line, flush=True)


# ---- transports: rank 1's side ------------------------------------------------------------------------------------
def _ring_peer(to_peer, conn, iters):
    from ember.distributed.channel import RingReader, RingWriter
    inbox = RingReader(to_peer, 0, busy_wait_s=1.0)
    outbox = RingWriter(1, busy_wait_s=1.0)
    conn.send(outbox.handle)
    conn.recv()
    for _ in range(iters):
        inbox.recv()
        outbox.send(b"ok")
    conn.recv()
    outbox.close()
    inbox.close()


def ring(blob: bytes, iters: int) -> float:
    from ember.distributed.channel import RingReader, RingWriter
    outbox = RingWriter(1, busy_wait_s=1.0)
    parent, child = mp.Pipe()
    peer = mp.get_context("spawn").Process(target=_ring_peer, args=(outbox.handle, child, iters))
    peer.start()
    inbox = RingReader(parent.recv(), 0, busy_wait_s=1.0)
    parent.send("go")
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        outbox.send(blob)
        inbox.recv()
        times.append(time.perf_counter() - t0)
    parent.send("done")
    peer.join()
    outbox.close()
    return 1e6 * statistics.median(times) / 2


def _zmq_peer(path, iters):
    import zmq
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(f"ipc://{path}.down")
    push.connect(f"ipc://{path}.up")
    for _ in range(iters + 1):
        pull.recv()
        push.send(b"ok")
    ctx.destroy(linger=0)


def zmq_pair(blob: bytes, iters: int) -> float:
    import os
    import tempfile
    import zmq
    path = os.path.join(tempfile.mkdtemp(), "step")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{path}.down")
    pull.bind(f"ipc://{path}.up")
    peer = mp.get_context("spawn").Process(target=_zmq_peer, args=(path, iters))
    peer.start()
    push.send(blob)
    pull.recv()                              # connected both ways
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        push.send(blob)
        pull.recv()
        times.append(time.perf_counter() - t0)
    peer.join()
    ctx.destroy(linger=0)
    return 1e6 * statistics.median(times) / 2


def _gloo_rank(rank, port, blob_len, iters, out):
    import datetime
    import torch
    import torch.distributed as dist
    from ember.distributed.channel import GlooBroadcast
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    channel, ack = GlooBroadcast(), torch.zeros(1, dtype=torch.int64)
    blob = bytes(blob_len)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if rank == 0:
            channel.send(blob)
        else:
            channel.recv()
        dist.broadcast(ack, src=1)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(1e6 * statistics.median(times) / 2)
    dist.destroy_process_group()


def gloo(blob: bytes, iters: int) -> float:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, len(blob), iters, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    encoding(args.iters)
    for label, step in [("decode 1", decode_step(1)), ("decode 64", decode_step(64)),
                        ("prefill 2048", prefill_step(2048))]:
        blob = pickle.dumps(("execute", step), protocol=5)
        print(f"one way {label} ({len(blob)} B): ring {ring(blob, args.iters):.1f} us, "
              f"zmq {zmq_pair(blob, args.iters):.1f} us, gloo {gloo(blob, args.iters):.1f} us", flush=True)


if __name__ == "__main__":
    main()
