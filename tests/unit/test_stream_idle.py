"""The device-idle figure of the structured-output benchmark: gaps between consecutive launches' (start, end) event
times in stream order, and a meter that records nothing off CUDA."""

import torch

from ember.runner.stream_idle import StreamIdle, idle_ms


def test_idle_is_the_sum_of_the_gaps_between_segments():
    # back to back (0), a 0.5 ms bubble, then a 1.25 ms one; the time before the first segment does not count
    assert idle_ms([(3.0, 4.0), (4.0, 6.0), (6.5, 7.0), (8.25, 9.0)]) == 1.75
    assert idle_ms([(0.0, 2.0)]) == 0.0 and idle_ms([]) == 0.0


def test_the_meter_records_nothing_off_cuda():
    meter = StreamIdle(torch.device("cpu"))
    meter.begin()
    meter.end()
    assert meter.take() is None
