"""What runs the model for an engine core, between the runner and the engine: `make_executor` gives rank 0's
`ModelRunner` for one rank, else a `MultiprocExecutor` (`multiproc`) that runs it beside the worker processes of
ranks 1..N-1 (`worker`), over the process groups and collectives of `ember.distributed`."""

from ember.executor.multiproc import MultiprocExecutor, WorkerFailure, make_executor

__all__ = ["MultiprocExecutor", "WorkerFailure", "make_executor"]
