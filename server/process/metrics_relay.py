"""Prometheus metrics of an engine in another process: the engine records into a MetricsRelay,
which keeps each call instead of counting it; the calls travel with the step's outputs and the
front end replays them on its own Metrics, the one registry /metrics renders. No shared files
(prometheus-client's multiprocess mode needs its directory set before the library is imported,
and gauges merged by mode), and the front end's own series (validation failures, grammar
compiles) live in the same registry as the engine's."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from server.metrics import Metrics
from server.process.messages import MetricEvent


class MetricsRelay:
    """Stands in for server.metrics.Metrics in the engine process (any public method of it)."""

    def __init__(self) -> None:
        self._events: list[MetricEvent] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("_") or not callable(getattr(Metrics, name, None)):
            raise AttributeError(name)

        def record(*args: object, **kwargs: object) -> None:
            self._events.append((name, args, kwargs))

        setattr(self, name, record)  # found directly from now on
        return record

    def drain(self) -> list[MetricEvent]:
        """The calls recorded since the last drain (the engine thread only)."""
        events, self._events = self._events, []
        return events


def replay(events: Iterable[MetricEvent], metrics: Metrics | None) -> None:
    if metrics is None:
        return
    for name, args, kwargs in events:
        getattr(metrics, name)(*args, **kwargs)
