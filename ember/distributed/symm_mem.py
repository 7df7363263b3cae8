"""The one-shot all-reduce over PyTorch's symmetric memory, for small messages on CUDA (`ops.all_reduce` routes).

Every rank of the group maps one buffer of every other rank (peer to peer, over NVLink). One kernel a rank copies
its message into its own buffer, waits at a barrier in the buffers' signal pads, and sums every peer's copy as it
reads them: one launch and one round of peer loads, where NCCL's ring pays several steps of latency that a small
message cannot hide. The decode step's all-reduces (a few rows of the hidden size) are such messages.

NVLink multicast (NVLS) stays off: no multimem op is called, and the executor starts every rank with
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NCCL_NVLS_ENABLE=0 (`parallel_state.COLLECTIVE_ENV`).

A message takes this kernel when it is of the buffer's dtype and at most `max_bytes`: a function of the shape, so
a CUDA graph's capture and its replays take the same path. `MAX_BYTES` is the crossover that
`benches/all_reduce_graph.py` measured against NCCL on two NVLink GPUs: the one-shot kernel was faster from 8 KiB to
2 MiB inside a CUDA graph (6.5 against 7.9 us at 8 KiB, 21.6 against 29.2 us at 2 MiB) and eagerly, NCCL from 4 MiB.

Larger messages (a large batch's decode step, a prefill chunk) can take torch's two-shot kernel over the same
buffer instead (`two_shot_max_bytes`): the message is copied into the buffer, each rank sums its 1/N of it from
every peer, then gathers the other ranks' sums, so every rank moves about 2(N-1)/N of the message over NVLink where
the one-shot kernel reads (N-1) whole copies. Off unless `EMBER_TWO_SHOT_MAX_BYTES` names a size (an A/B switch:
`benches/all_reduce_graph.py` measures the crossover).
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("ember")


def _env_bytes(name: str, default: int = 0) -> int:
    value = os.environ.get(name, str(default))
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a byte count (a whole number, 0 for none)")
    return int(value)


MAX_BYTES = _env_bytes("EMBER_ONE_SHOT_MAX_BYTES", 2 * 1024 * 1024)      # env: an A/B switch
# messages above MAX_BYTES up to this many bytes take the two-shot kernel (0: none; an A/B switch, module docstring)
TWO_SHOT_MAX_BYTES = _env_bytes("EMBER_TWO_SHOT_MAX_BYTES")
ON_BY_DEFAULT = True        # whether symm_mem_all_reduce=None (the default) takes the kernel on CUDA
# the group names this process has set a symmetric buffer up for: torch keeps a group name's rendezvous (its store)
# for the life of the process, and a later group of the same name (an engine started after another one stopped)
# would meet at the old store; such a group takes NCCL
_rendezvoused: set[str] = set()


class OneShotAllReduce:
    """A symmetric buffer of `max_bytes` in `dtype` on `device`, set up on every rank of `process_group` at once
    (a collective); calling it reduces one message through the buffer."""

    def __init__(self, process_group, device: torch.device, max_bytes: int = MAX_BYTES,
                 dtype: torch.dtype = torch.bfloat16, two_shot_max_bytes: int | None = None):
        import torch.distributed._symmetric_memory as symm
        if device is None or device.type != "cuda":
            raise ValueError(f"the symmetric-memory all-reduce needs a CUDA device, got {device}")
        self.group_name = process_group.group_name
        two_shot = TWO_SHOT_MAX_BYTES if two_shot_max_bytes is None else two_shot_max_bytes
        if two_shot < 0 or two_shot % 16:
            raise ValueError(f"two_shot_max_bytes must be 0 (none) or a positive multiple of 16, got {two_shot}")
        self.dtype, self.one_shot_max = dtype, max_bytes
        self.max_bytes = max(max_bytes, two_shot)           # one-shot up to one_shot_max, two-shot above
        _use_peer_to_peer_backend(symm, device)
        if _torch_before(2, 8):         # symmetric memory is enabled per group before torch 2.8, always after
            symm.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm.empty(self.max_bytes // dtype.itemsize, dtype=dtype, device=device)  # [max_bytes / size]
        _rendezvoused.add(self.group_name)
        symm.rendezvous(self.buffer, self.group_name)
        logger.info("all-reduces of at most %d bytes of %s take the symmetric-memory one-shot kernel%s", max_bytes,
                    dtype, f", up to {self.max_bytes} the two-shot kernel" if self.max_bytes > max_bytes else "")

    def applies(self, x: torch.Tensor) -> bool:
        """Whether `x` is a message for this buffer: on CUDA, of its dtype, contiguous, at most max_bytes."""
        return (x.is_cuda and x.dtype == self.dtype and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, a new tensor; the kernel copies x into this rank's buffer itself."""
        slot = self.buffer.narrow(0, 0, x.numel()).view(x.shape)
        if x.numel() * x.element_size() <= self.one_shot_max:
            return torch.ops.symm_mem.one_shot_all_reduce_copy(slot, x, "sum", self.group_name)
        slot.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_out(slot, "sum", self.group_name, torch.empty_like(x))


def one_shot_by_default(process_group, device: torch.device | None) -> bool:
    """What `symm_mem_all_reduce=None` means for this group: `ON_BY_DEFAULT` on CUDA where `one_shot_possible`,
    else NCCL, said in the log. A collective on CUDA: every rank decides alike."""
    if not ON_BY_DEFAULT or device is None or device.type != "cuda":
        return False
    possible, reason = one_shot_possible(process_group, device)
    if not possible:
        logger.warning("the symmetric-memory all-reduce is off: %s; every all-reduce takes NCCL", reason)
    return possible


def one_shot_possible(process_group, device: torch.device) -> tuple[bool, str]:
    """Whether every rank's GPU can map the other local GPUs (peer access) and no rank set a buffer up for an
    earlier group of the same name in its process; if not, why. All ranks decide alike (a gloo all-reduce), so
    none starts a rendezvous that another skips."""
    import torch.distributed as dist
    peers = range(torch.cuda.device_count())
    reach = all(torch.cuda.can_device_access_peer(device.index, p) for p in peers if p != device.index)
    fresh = process_group.group_name not in _rendezvoused
    flags = torch.tensor([int(reach), int(fresh)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=process_group)      # the group's host (gloo) backend
    if not flags[0].item():
        return False, "a GPU of the group cannot reach its peers (peer access)"
    if not flags[1].item():
        return False, ("a rank's process set it up for an earlier group of the same name, and torch keeps that "
                       "set-up for the process's life")
    return True, ""


def _use_peer_to_peer_backend(symm, device: torch.device) -> None:
    """Allocate through the CUDA backend (peer mappings over CUDA IPC), not NVSHMEM: the one-shot kernel needs only
    peer loads, and NVSHMEM would start a runtime of its own. Where the backend is already chosen it stays."""
    if not hasattr(symm, "set_backend"):
        return                          # before torch 2.8 the CUDA backend is the only one
    try:
        # "CUDA" answered: the default allocator is that backend already (it is registered as the device's
        # default, not by name, so naming it would be refused)
        if symm.get_backend(device) is None:
            symm.set_backend("CUDA")
    except Exception as e:              # noqa: BLE001 - a symmetric tensor exists already: its backend stays
        logger.info("symmetric memory keeps its backend: %s", e)


def _torch_before(major: int, minor: int) -> bool:
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return version < (major, minor)
