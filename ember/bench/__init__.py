"""`ember bench`: throughput and latency runs, the roofline beside each figure, and the step profiler."""
