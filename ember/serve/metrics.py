"""Prometheus metrics of the server: load gauges read at scrape time, latency histograms and token counters fed
as outputs arrive. Each app has its own registry, so that several servers can live in one process (tests)."""

from __future__ import annotations

from ember.engine.request import RequestOutput
from ember.serve.async_engine import EngineLoad, RequestStream

# seconds; dense below 100 ms, where decode latencies live, up to minutes for queued prefills
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The collectors behind `/metrics`, labelled with the served model's name; with the process's own (resident
    memory, CPU time, open files) and, for an engine on CUDA, the device memory torch holds."""

    def __init__(self, model_name: str, device=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
        self.registry = CollectorRegistry()
        reg, label = self.registry, ["model_name"]
        ProcessCollector(registry=reg)

        def gauge(name, doc):
            return Gauge(name, doc, label, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, label, registry=reg).labels(model_name)

        self.num_running = gauge("ember_num_requests_running", "Requests the engine is running")
        self.num_waiting = gauge("ember_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("ember_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)")
        self.time_to_first_token = histogram("ember_time_to_first_token_seconds",
                                             "From a request's arrival to its first output token", TTFT_BUCKETS)
        self.inter_token_latency = histogram("ember_inter_token_latency_seconds",
                                             "Time between consecutive output tokens of a request", ITL_BUCKETS)
        self.e2e_latency = histogram("ember_e2e_request_latency_seconds",
                                     "From a request's arrival to its last output token", E2E_BUCKETS)
        self.spec_draft_tokens = gauge("ember_spec_decode_num_draft_tokens", "Proposed tokens verified (total)")
        self.spec_accepted_tokens = gauge("ember_spec_decode_num_accepted_tokens", "Proposed tokens accepted (total)")
        self.spec_acceptance_rate = gauge("ember_spec_decode_acceptance_rate", "Accepted / proposed tokens")
        self.spec_mean_acceptance_length = gauge("ember_spec_decode_mean_acceptance_length",
                                                 "Tokens a verified request emits per step (accepted + 1)")
        self.tokens_per_step = gauge("ember_tokens_per_step", "Generated tokens per engine step")
        self.prompt_tokens = counter("ember_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("ember_generation_tokens", "Output tokens generated")
        self._finished = Counter("ember_request_success", "Finished requests, by finish reason",
                                 ["model_name", "finished_reason"], registry=reg)
        # where requests are held: the server's streams, the engine's output state, the runner's request table
        held = Gauge("ember_num_requests_held", "Requests held, by holder (server, engine, runner)",
                     ["model_name", "holder"], registry=reg)
        self._held = {holder: held.labels(model_name, holder) for holder in ("server", "engine", "runner")}
        self._device = device if device is not None and device.type == "cuda" else None
        if self._device is not None:
            self.gpu_allocated = gauge("ember_gpu_memory_allocated_bytes", "Device memory torch has allocated")
            self.gpu_reserved = gauge("ember_gpu_memory_reserved_bytes", "Device memory torch's allocator holds")
        self._model_name = model_name

    def on_tokens(self, stream: RequestStream, num_new: int, now: float) -> None:
        """Record `num_new` tokens that reached `stream` at `now` (perf_counter seconds)."""
        self.generation_tokens.inc(num_new)
        if stream.last_token_at is None:
            self.time_to_first_token.observe(now - stream.arrival)
            num_new -= 1
            if num_new == 0:
                return
            last = now
        else:
            last = stream.last_token_at
        # tokens that arrive together share the gap since the last ones
        gap = (now - last) / num_new
        for _ in range(num_new):
            self.inter_token_latency.observe(gap)

    def on_finish(self, stream: RequestStream, output: RequestOutput) -> None:
        """Record a request that finished."""
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        self.e2e_latency.observe((stream.last_token_at or stream.arrival) - stream.arrival)
        for completion in output.outputs:
            self._finished.labels(self._model_name, completion.finish_reason or "unknown").inc()

    def render(self, load: EngineLoad, num_unfinished: int = 0) -> bytes:
        """The text exposition format, with the load gauges set from `load` and the server's `num_unfinished`
        streams."""
        from prometheus_client import generate_latest
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.kv_cache_usage.set(load.kv_cache_usage)
        self.spec_draft_tokens.set(load.num_draft_tokens)
        self.spec_accepted_tokens.set(load.num_accepted_tokens)
        if load.spec_summary is not None:
            self.spec_acceptance_rate.set(load.spec_summary["acceptance_rate"])
            self.spec_mean_acceptance_length.set(load.spec_summary["mean_acceptance_length"])
            self.tokens_per_step.set(load.spec_summary["tokens_per_step"])
        for holder, count in (("server", num_unfinished), ("engine", load.num_tracked),
                              ("runner", load.num_runner_rows)):
            self._held[holder].set(count)
        if self._device is not None:
            import torch
            self.gpu_allocated.set(torch.cuda.memory_allocated(self._device))
            self.gpu_reserved.set(torch.cuda.memory_reserved(self._device))
        return generate_latest(self.registry)
