"""`CUDAGraphManager.pause()`: while paused, wrappers call their function directly, so start-up warm-up steps under
lazy capture neither capture a graph nor count as a bucket's first use (CPU: no graph is ever made here)."""

from ember.attention_backends.op import ForwardContext, forward_context
from ember.graphs.cuda_graph import CUDAGraphManager
from ember.graphs.modes import BatchDescriptor, CUDAGraphMode


def test_paused_wrappers_pass_through_and_count_no_use():
    manager = CUDAGraphManager("cpu", lazy=True)
    calls = []
    wrapper = manager.wrap_full(lambda x: calls.append(x) or x)
    desc = BatchDescriptor(8, 8, True)
    with forward_context(ForwardContext((), (), desc, CUDAGraphMode.FULL)):
        with manager.pause():
            assert manager.paused
            assert wrapper(1) == 1 and wrapper(2) == 2
        assert not manager.paused
        assert not wrapper.warmed and not wrapper.entries
        assert wrapper(3) == 3             # the first use after the pause: run without a graph, remembered
        assert wrapper.warmed == {desc} and not wrapper.entries
    assert calls == [1, 2, 3]
