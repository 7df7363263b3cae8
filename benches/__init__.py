"""ember benchmarks (pytest-benchmark suites)."""
