"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def gemv_unrouted():
    """For tests of the GEMV kernel itself: the ops take it at every row count it applies to, whatever the
    measured GEMV/cuBLAS crossover (ember.kernels.gemv_routing) would send to cuBLAS."""
    from ember.kernels.linear_op import set_gemv_routing
    set_gemv_routing(False)
    yield
    set_gemv_routing(True)
