"""OpenTelemetry tracing of collective calls (``Config.tracing``), the driver's half.

Each ``collective_rpc`` runs inside a span ``mpx.collective_rpc <method>`` of kind CLIENT, a
child of the caller's current span, with ``rpc.system.name = "mpx"``, ``rpc.method`` and
``mpx.world_size``; a call that fails sets its status to ERROR and ``error.type``. Its
context travels with the call as W3C trace-context headers (``traceparent``), from which each
worker makes its SERVER span (mpx/_worker/tracing.py). A non-blocking call's span ends when
its future completes (in the thread that completes it, outside every mpx lock).

Only imported when tracing is on and ``opentelemetry-api`` is installed (``available()``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any


def available() -> bool:
    """Whether ``opentelemetry-api`` can be imported here."""
    return importlib.util.find_spec("opentelemetry") is not None and \
        importlib.util.find_spec("opentelemetry.trace") is not None


def traced_call(call: Callable[[dict[str, str]], Any], name: str, world_size: int,
                non_block: bool) -> Any:
    """``call(headers)`` inside the call's CLIENT span; its result (a future's span ends
    when the future completes)."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    tracer = trace.get_tracer("mpx")
    span = tracer.start_span(f"mpx.collective_rpc {name}", kind=trace.SpanKind.CLIENT,
                             attributes={"rpc.system.name": "mpx", "rpc.method": name,
                                         "mpx.world_size": world_size})
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            out = call(headers)
    except BaseException as e:
        _end(span, e)
        raise
    if non_block:
        out.add_done_callback(lambda fut: _end(span, fut.exception()))
    else:
        _end(span, None)
    return out


def _end(span: Any, error: BaseException | None) -> None:
    from opentelemetry.trace import Status, StatusCode

    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        span.set_attribute("error.type", type(error).__qualname__)
    span.end()
