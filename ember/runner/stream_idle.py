"""`StreamIdle`: how long the device's stream sat idle between the launches a step loop enqueues, measured with CUDA
events (the benchmark's figure for host work on the device's critical path).

The host brackets each launch with `begin()` and `end()`; each records an event on the current stream. An event
completes when the stream reaches it, so a segment's start is when the device could begin that launch: the end of
the work before it, or the moment the host enqueued it, whichever came later. Idle time is the sum of the gaps
between one segment's end and the next one's start; a gap between two segments enqueued back to back is 0.
"""

from __future__ import annotations

import torch


def idle_ms(segments: list[tuple[float, float]]) -> float:
    """Total gap in ms between consecutive (start, end) segments in stream order (the first's start excluded)."""
    return sum(max(0.0, start - prev_end) for (_, prev_end), (start, _) in zip(segments, segments[1:]))


class StreamIdle:
    """Records (start, end) event pairs on `device`'s current stream; `take()` returns the idle and busy ms of the
    segments recorded since the last call and how many there were. A no-op off CUDA (`take()` returns None)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event | None]] = []

    def begin(self) -> None:
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events.append((event, None))

    def end(self) -> None:
        if self.enabled and self._events and self._events[-1][1] is None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events[-1] = (self._events[-1][0], event)

    def take(self) -> tuple[float, float, int] | None:
        """(idle ms, busy ms, segments) since the last call; waits for the last segment to finish."""
        events, self._events = [(s, e) for s, e in self._events if e is not None], []
        if not self.enabled or not events:
            return None
        events[-1][1].synchronize()
        origin = events[0][0]
        segments = [(origin.elapsed_time(s), origin.elapsed_time(e)) for s, e in events]
        return idle_ms(segments), sum(e - s for s, e in segments), len(segments)
