"""OpenTelemetry tracing of collective calls (``Config.tracing``), the worker's half: a call
that carries the driver's trace context (W3C ``traceparent``, mpx/_driver/tracing.py) runs
inside a SERVER span ``mpx.worker <method>``, a child of the driver's span, with
``rpc.system.name``, ``rpc.method`` and ``mpx.rank``; a method that raises sets it to ERROR
(with the exception recorded). The span goes to the tracer provider the worker's process
set up (for example in its ``__init__``); without ``opentelemetry-api`` installed here the
method runs untraced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # (tracing is optional: the driver sent a context nobody here reads)
    trace = None  # type: ignore[assignment]


def run_traced(headers: dict[str, str], name: str, rank: int, fn: Callable[..., Any],
               *args: Any) -> Any:
    """``fn(*args)`` inside the call's SERVER span, whose parent the ``headers`` name."""
    if trace is None:
        return fn(*args)
    parent = TraceContextTextMapPropagator().extract(headers)
    with trace.get_tracer("mpx").start_as_current_span(
            f"mpx.worker {name}", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"rpc.system.name": "mpx", "rpc.method": name, "mpx.rank": rank}) as span:
        try:
            return fn(*args)
        except BaseException as e:
            span.set_attribute("error.type", type(e).__qualname__)
            raise
