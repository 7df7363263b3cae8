"""This process's place among the tensor-parallel ranks, and the process group they share.

One process a GPU. `init_tensor_parallel` joins the group once, at start-up, before the model is built; after that
`tensor_parallel()` says (rank, size), the model's collectives (`ember.distributed.ops`) reduce over the group
named `TP_GROUP`, and `agree` settles a start-up decision the same way on every rank (the KV-cache size each
measured, whether the Triton kernels need a dry pass). A process that never joins one is rank 0 of 1: its model is
built whole and holds no collective.

On CUDA the group has two backends, NCCL for device tensors and gloo for host ones; on the CPU, gloo only.
The ranks meet at a TCP store: its host is MASTER_ADDR where that is set (ranks on several hosts), else this host's
loopback, and its port MASTER_PORT, else one the store picks (`Rendezvous`). Each data-parallel replica's ranks
form a group of their own, at a store of their own (`replica_rendezvous`). Nothing here assumes one host: the local
rank (which GPU) is given apart from the rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ember.distributed.shard import ShardSpec

logger = logging.getLogger("ember")

TP_GROUP = "tp"     # the name the model's collectives reduce over (ember.distributed.ops)

# every rank's environment (defaults: a value the user set stands): NVLink multicast (NVLS) off, in NCCL, in
# PyTorch's symmetric memory and in NVSHMEM; NCCL's tensors kept by their work objects rather than by
# record_stream, which a CUDA graph's capture does not take
COLLECTIVE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                  "TORCH_NCCL_AVOID_RECORD_STREAMS": "1"}


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one replica meet: a TCP store at (host, port); port 0 lets rank 0's store pick one."""
    host: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def from_environment(cls) -> "Rendezvous":
        """MASTER_ADDR and MASTER_PORT where they are set (as torchrun sets them), else this host, any port."""
        port = os.environ.get("MASTER_PORT", "0")
        if not port.isdigit():
            raise ValueError(f"MASTER_PORT {port!r} is not a port number; set it to a free TCP port or unset it")
        return cls(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(port))


def replica_rendezvous(num_replicas: int) -> list[Rendezvous]:
    """Where the ranks of each of `num_replicas` data-parallel replicas meet, each at a store of its own: with no
    MASTER_PORT set, a port each replica's store picks; with one, MASTER_PORT + the replica's index. ValueError naming
    the ports when that range runs past the last port or one of them is in use on this host (rank 0 of every replica,
    which serves its store, runs here)."""
    base = Rendezvous.from_environment()
    if base.port == 0:
        return [base] * num_replicas
    last = base.port + num_replicas - 1
    if last > 65535:
        raise ValueError(f"MASTER_PORT {base.port} with data_parallel_size {num_replicas}: replica i's ranks meet at "
                         f"MASTER_PORT + i, and {last} is past the last port (65535); lower MASTER_PORT or unset it "
                         f"(each replica's store then picks a free port)")
    taken = [port for port in range(base.port, last + 1) if not _port_free(port)]
    if taken:
        raise ValueError(f"MASTER_PORT {base.port} with data_parallel_size {num_replicas}: replica i's ranks meet at "
                         f"MASTER_PORT + i (ports {base.port}-{last}), and {', '.join(map(str, taken))} "
                         f"{'is' if len(taken) == 1 else 'are'} in use on this host; set MASTER_PORT to the first of "
                         f"{num_replicas} free ports, or unset it (each replica's store then picks a free port)")
    return [Rendezvous(base.host, base.port + i) for i in range(num_replicas)]


def _port_free(port: int) -> bool:
    """Whether a store could listen on `port` of this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the store does: TIME_WAIT is no owner
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def open_store(rendezvous: Rendezvous, rank: int, world_size: int, timeout_s: float):
    """The TCP store of a rendezvous: rank 0 serves it (on the port it was given, or a free one: its `.port`),
    every other rank connects to it."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        return dist.TCPStore(rendezvous.host, rendezvous.port, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=False)
    return dist.TCPStore(rendezvous.host, rendezvous.port, world_size, is_master=False, timeout=timeout)


@dataclass(frozen=True)
class TensorParallelInfo:
    """This process's rank among `size` tensor-parallel ranks, and the GPU it drives on its host."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one whose step results go to the host."""
        return self.rank == 0


_joined: TensorParallelInfo | None = None
TEARDOWN_S = 20.0          # how long leaving the group may take before its teardown is left to the exit


def tensor_parallel() -> TensorParallelInfo:
    """This process's rank and group size (rank 0 of 1 when it joined no group)."""
    return _joined if _joined is not None else TensorParallelInfo()


def joined_shard(tensor_parallel_size: int, expert_parallel: bool = False) -> tuple[TensorParallelInfo, ShardSpec]:
    """This process's rank and the model shard it holds (whole experts where `expert_parallel`); RuntimeError when
    its group is not of the configured size (a runner of a tensor-parallel engine starts only in a process that
    joined the group: `make_executor`)."""
    info = tensor_parallel()
    if info.size != tensor_parallel_size:
        raise RuntimeError(f"tensor_parallel_size {tensor_parallel_size}, but this process is rank {info.rank} of "
                           f"{info.size}; start tensor-parallel runners through ember.executor")
    return info, ShardSpec(info.rank, info.size, expert_parallel)


# what the first symmetric-memory allocation imports (torch's symbolic shapes, and sympy with them): about 0.3 s with
# compiled bytecode, 2.3 s without; on a thread it overlaps the join's waits (the store, NCCL's connect), which
# release the GIL, and the allocation then finds it imported (Python's import lock makes it wait if it is not yet)
SYMM_MEM_FIRST_IMPORT = "torch.fx.experimental.symbolic_shapes"


def _import_on_a_thread(module: str) -> None:
    import importlib
    if module not in sys.modules:
        threading.Thread(target=importlib.import_module, args=(module,), name="ember-import", daemon=True).start()


def init_tensor_parallel(rank: int, size: int, local_rank: int, device_type: str, store, timeout_s: float,
                         symm_mem_all_reduce: bool | None = None) -> TensorParallelInfo:
    """Join the tensor-parallel group of `size` ranks as `rank` through `store` (see `open_store`); on CUDA this
    process's device becomes GPU `local_rank` first, and NCCL connects eagerly (a CUDA graph cannot capture its
    set-up). Once per process."""
    global _joined
    import torch.distributed as dist
    from ember.distributed import ops
    if _joined is not None or dist.is_initialized():
        raise RuntimeError(f"this process already belongs to a process group (another engine's, or one whose "
                           f"teardown did not finish); ember's tensor-parallel rank {rank} cannot join another")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    kwargs = {}
    if device_type == "cuda" and symm_mem_all_reduce is not False:
        _import_on_a_thread(SYMM_MEM_FIRST_IMPORT)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
        kwargs["device_id"] = torch.device("cuda", local_rank)
    else:
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    group = dist.group.WORLD
    ops.register_group(TP_GROUP, group, torch.device(device_type, local_rank) if device_type == "cuda" else None,
                       symm_mem_all_reduce)
    _joined = TensorParallelInfo(rank, size, local_rank)
    logger.info("tensor-parallel rank %d of %d (%s, local rank %d) joined", rank, size, backend, local_rank)
    return _joined


def agree(values: list[int], op: str) -> list[int]:
    """Each value's minimum ("min") or maximum ("max") over the ranks, on the host (gloo): a start-up decision
    every rank must take alike. The values themselves without a group."""
    if _joined is None or _joined.size == 1:
        return list(values)
    import torch.distributed as dist
    reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def leave_tensor_parallel(wait_s: float = TEARDOWN_S, release: Callable[[], object] | None = None) -> bool:
    """Leave the group (at shutdown, after a failure too): ember's ops forget it at once, and the communicators are
    torn down in a thread given `wait_s`, after `release` (the rank's CUDA graphs: NCCL's teardown waits for graphs
    that hold its work; dropping them waits for the device, so it runs under the same bound). NCCL's teardown of a communicator can wait for its peers' teardown, so at
    shutdown every rank starts its own at about the same time (rank 0 as soon as it has told the workers to stop,
    not after they exit); one that does not finish in time (a peer gone mid-teardown) is left to the process's
    exit with a warning, and this process cannot join another group. Whether the teardown finished."""
    global _joined
    import torch.distributed as dist
    from ember.distributed import ops
    ops.unregister_group(TP_GROUP)
    _joined = None
    if not dist.is_initialized():
        return True
    done = threading.Event()

    def teardown() -> None:
        try:
            if release is not None:
                release()
            if "nccl" in str(dist.get_backend_config()):
                dist.distributed_c10d._abort_process_group()    # no flush: every rank has finished its steps
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:      # noqa: BLE001 - a group whose peers are gone: nothing is left to release
            logger.warning("leaving the tensor-parallel group: %s", e)
        finally:
            done.set()

    threading.Thread(target=teardown, name="ember-tp-teardown", daemon=True).start()
    if done.wait(wait_s):
        return True
    logger.warning("leaving the tensor-parallel group: its teardown did not finish in %.0f s (a peer left before "
                   "its own); the communicators stay until this process exits, and it cannot join another group",
                   wait_s)
    return False
