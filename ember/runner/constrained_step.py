"""A step with grammar rows, in two launches around its bitmask: `launch_forward(step, split)`, then, once the
engine has filled the bitmask on the host, `launch_sample(launched, num_rows)`. Bound as `ModelRunner` methods; the
multi-process executor sends each call to the other ranks as a message of its own, so every rank launches its
forward before rank 0's bitmask exists and its sampling after rank 0 has put it.

How a step runs (`ConstrainedStep.route`):
- "split": a FULL decode graph would sample it: the forward alone (`SplitDecode.forward`), then the decode tail's
  graph, which under tensor parallelism first broadcasts rank 0's bitmask rows (`GrammarMask.share`) on the device;
- "whole": the same step with the split off (`EMBER_GRAMMAR_SPLIT=0`): nothing launched before the bitmask, then its
  broadcast and the one graph of forward and tail;
- "after": any other step (mixed, piecewise, eager): the forward, then the bitmask's broadcast and the sampler.

`EMBER_GRAMMAR_AS_GRAPH=1` is a debugging aid: a uniform decode step that no FULL graph samples (the CPU) takes the
routes a FULL graph's would, eagerly, so that the split's order and its broadcast run without a GPU."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ember.graphs.modes import CUDAGraphMode
from ember.profiling import section
from ember.runner.sampling_inputs import fits_graph_tail

AS_GRAPH_ENV = "EMBER_GRAMMAR_AS_GRAPH"


@dataclass
class ConstrainedStep:
    """A constrained step whose forward is launched (or, "whole", only prepared): what `launch_sample` finishes."""
    prepared: object                    # ModelRunner's PreparedStep
    route: str                          # "split", "whole" or "after"
    hidden: torch.Tensor | None = None  # the forward's output ("after")


def graph_samples(runner, prepared) -> bool:
    """Whether a FULL decode graph samples the step (its tail's tokens stand): its grammar bitmask must then be in
    place before the graph's sampling, so the step runs split, or with the bitmask put first."""
    desc = prepared.desc
    if desc is None or not desc.uniform_decode or not fits_graph_tail(prepared.plan):
        return False
    if runner._forward_samples and prepared.mode == CUDAGraphMode.FULL and desc.num_reqs is not None:
        return True
    return os.environ.get(AS_GRAPH_ENV) == "1"


def forward_alone(runner, prepared) -> None:
    """The split step's first launch (`SplitDecode`)."""
    desc = prepared.desc
    runner.split.num_rows = desc.num_reqs if desc.num_reqs is not None else prepared.batch.common.num_reqs
    with section("ember.forward"):
        runner._run(prepared.batch, prepared.mode, desc, fn=runner.split.forward)


def sample_alone(runner, prepared):
    """The split step's second launch, after the bitmask: the decode tail, then the tokens' way to the host."""
    with section("ember.sample"):
        return runner.sample_step(prepared, None, runner.split.sample(prepared.desc, prepared.mode))


def launch_forward(runner, step, split: bool = True, idle=None) -> ConstrainedStep:
    """Prepare the step and launch what may run before its bitmask exists; `split`: the engine's choice for a step
    a FULL decode graph samples (False: run it whole after the bitmask); `idle`: a `StreamIdle` the forward's
    launch is bracketed in (the benchmark's, on rank 0)."""
    prepared = runner.prepare_step(step)
    if runner.graph_samples(prepared):
        if not split:
            return ConstrainedStep(prepared, "whole")
        route, hidden = "split", None
    else:
        route = "after"
    if idle is not None:
        idle.begin()
    if route == "split":
        runner.forward_alone(prepared)
    else:
        hidden, _ = runner.forward(prepared)
    if idle is not None:
        idle.end()
    return ConstrainedStep(prepared, route, hidden)


def launch_sample(runner, launched: ConstrainedStep, num_rows: int):
    """Put the first `num_rows` rows of the bitmask the engine filled (rank 0), share them with every rank, and
    launch the step's sampling; returns what `ModelRunner.execute_async` does."""
    if runner.tp.is_driver:
        runner.grammar.put(num_rows)
    prepared = launched.prepared
    if launched.route == "split":
        return runner.sample_alone(prepared)        # the tail shares the bitmask first, inside its graph
    runner.grammar.share(num_rows)
    if launched.route == "whole":
        return runner.sample_step(prepared, *runner.forward(prepared))
    return runner.sample_step(prepared, launched.hidden)
