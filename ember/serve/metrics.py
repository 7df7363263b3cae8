"""Prometheus metrics of the server: load gauges and the engine cores' counters read at scrape time, latency
histograms and token counters fed as outputs arrive, and this process's own (resident memory, CPU time, open
files) beside each core process's resident memory. Every figure of a core or of the requests it served carries its replica (`replica="0"`). Each app has its
own registry, so that several servers can live in one process (tests)."""

from __future__ import annotations

import time

from ember.engine.core_io import CoreStats
from ember.serve.async_engine import RequestStream

# seconds; dense below 100 ms, where decode latencies live, up to minutes for queued prefills
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The collectors behind `/metrics`, labelled with the served model's name and the replica."""

    def __init__(self, model_name: str, num_replicas: int = 1, cuda: bool = False):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name", "replica"]
        ProcessCollector(registry=reg)
        replicas = [str(i) for i in range(num_replicas)]

        def per_replica(kind, name, doc, **kwargs):
            metric = kind(name, doc, labels, registry=reg, **kwargs)
            return [metric.labels(model_name, r) for r in replicas]

        self.num_running = per_replica(Gauge, "ember_num_requests_running", "Requests the engine is running")
        self.num_waiting = per_replica(Gauge, "ember_num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = per_replica(Gauge, "ember_kv_cache_usage_perc",
                                          "Fraction of KV-cache blocks in use (0 to 1)")
        self.time_to_first_token = per_replica(Histogram, "ember_time_to_first_token_seconds",
                                               "From a request's arrival to its first output token",
                                               buckets=TTFT_BUCKETS)
        self.inter_token_latency = per_replica(Histogram, "ember_inter_token_latency_seconds",
                                               "Time between consecutive output tokens of a request",
                                               buckets=ITL_BUCKETS)
        self.e2e_latency = per_replica(Histogram, "ember_e2e_request_latency_seconds",
                                       "From a request's arrival to its last output token", buckets=E2E_BUCKETS)
        self.prompt_tokens = per_replica(Counter, "ember_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = per_replica(Counter, "ember_generation_tokens", "Output tokens generated")
        self.core_steps = per_replica(Counter, "ember_engine_core_steps", "Steps the engine core ran")
        self.core_step_seconds = per_replica(Counter, "ember_engine_core_step_seconds",
                                             "Wall time the engine core spent in steps")
        self.core_busy_seconds = per_replica(Counter, "ember_engine_core_busy_seconds",
                                             "Host time the engine core was busy: steps less their waits for "
                                             "the device, and its messages")
        self.preemptions = per_replica(Counter, "ember_num_preemptions", "Requests preempted to free KV blocks")
        self.spec_draft_tokens = per_replica(Gauge, "ember_spec_decode_num_draft_tokens",
                                             "Proposed tokens verified (total)")
        self.spec_accepted_tokens = per_replica(Gauge, "ember_spec_decode_num_accepted_tokens",
                                                "Proposed tokens accepted (total)")
        self.spec_acceptance_rate = per_replica(Gauge, "ember_spec_decode_acceptance_rate",
                                                "Accepted / proposed tokens")
        self.spec_mean_acceptance_length = per_replica(Gauge, "ember_spec_decode_mean_acceptance_length",
                                                       "Tokens a verified request emits per step (accepted + 1)")
        self.tokens_per_step = per_replica(Gauge, "ember_tokens_per_step", "Generated tokens per engine step")
        self.frontend_busy_seconds = Counter("ember_frontend_busy_seconds",
                                             "CPU time of the front end's event loop (HTTP, JSON, text, streams)",
                                             ["model_name"], registry=reg).labels(model_name)
        self._finished = Counter("ember_request_success", "Finished requests, by finish reason",
                                 ["model_name", "replica", "finished_reason"], registry=reg)
        # where requests are held: the server's streams, the engine core, the runner's request table
        held = Gauge("ember_num_requests_held", "Requests held, by holder (server, engine, runner)",
                     ["model_name", "replica", "holder"], registry=reg)
        self._held = [{holder: held.labels(model_name, r, holder) for holder in ("server", "engine", "runner")}
                      for r in replicas]
        self.core_resident = per_replica(Gauge, "ember_engine_core_resident_memory_bytes",
                                         "Resident memory of the engine core's process (0 where it runs in this one)")
        self._cuda = cuda
        if cuda:
            self.gpu_allocated = per_replica(Gauge, "ember_gpu_memory_allocated_bytes",
                                             "Device memory torch has allocated in the engine core")
            self.gpu_reserved = per_replica(Gauge, "ember_gpu_memory_reserved_bytes",
                                            "Device memory torch's allocator holds in the engine core")
        self._model_name = model_name
        self._seen = [CoreStats() for _ in replicas]   # the counters as of the last scrape
        self._loop_cpu: float | None = None   # the loop thread's CPU time at the last scrape (none before the first)

    def on_tokens(self, stream: RequestStream, num_new: int, now: float) -> None:
        """Record `num_new` tokens that reached `stream` at `now` (perf_counter seconds)."""
        replica = stream.replica
        self.generation_tokens[replica].inc(num_new)
        if stream.last_token_at is None:
            self.time_to_first_token[replica].observe(now - stream.arrival)
            num_new -= 1
            if num_new == 0:
                return
            last = now
        else:
            last = stream.last_token_at
        # tokens that arrive together share the gap since the last ones
        gap = (now - last) / num_new
        itl = self.inter_token_latency[replica]
        for _ in range(num_new):
            itl.observe(gap)

    def on_finish(self, stream: RequestStream, finish_reasons: list[str | None]) -> None:
        """Record a request that finished, with each of its completions' finish reasons."""
        replica = stream.replica
        self.prompt_tokens[replica].inc(stream.num_prompt_tokens)
        self.e2e_latency[replica].observe((stream.last_token_at or stream.arrival) - stream.arrival)
        for reason in finish_reasons:
            self._finished.labels(self._model_name, str(replica), reason or "unknown").inc()

    def render(self, stats: list[CoreStats], num_streams: list[int]) -> bytes:
        """The text exposition format, with the load gauges and core counters set from each replica's latest
        stats, and the server's open streams per replica. Call it on the event loop's thread: the front end's busy
        time is that thread's CPU time, counted from the first scrape on."""
        from prometheus_client import generate_latest
        for replica, (now, seen) in enumerate(zip(stats, self._seen)):
            self.num_running[replica].set(now.num_running)
            self.num_waiting[replica].set(now.num_waiting)
            self.kv_cache_usage[replica].set(now.kv_cache_usage)
            self.spec_draft_tokens[replica].set(now.num_draft_tokens)
            self.spec_accepted_tokens[replica].set(now.num_accepted_tokens)
            summary = now.spec_summary()
            self.spec_acceptance_rate[replica].set(summary["acceptance_rate"])
            self.spec_mean_acceptance_length[replica].set(summary["mean_acceptance_length"])
            self.tokens_per_step[replica].set(summary["tokens_per_step"])
            held = self._held[replica]
            held["server"].set(num_streams[replica])
            held["engine"].set(now.num_requests)
            held["runner"].set(now.num_runner_rows)
            self.core_resident[replica].set(now.resident_memory)
            if self._cuda:
                self.gpu_allocated[replica].set(now.gpu_memory_allocated)
                self.gpu_reserved[replica].set(now.gpu_memory_reserved)
            for counter, field in ((self.core_steps, "num_steps"), (self.core_step_seconds, "step_s"),
                                   (self.core_busy_seconds, "busy_s"), (self.preemptions, "num_preemptions")):
                delta = getattr(now, field) - getattr(seen, field)
                if delta > 0:
                    counter[replica].inc(delta)
            self._seen[replica] = now
        cpu = time.thread_time()
        if self._loop_cpu is not None:
            self.frontend_busy_seconds.inc(max(cpu - self._loop_cpu, 0.0))
        self._loop_cpu = cpu
        return generate_latest(self.registry)
