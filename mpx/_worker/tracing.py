"""OpenTelemetry tracing of collective calls (``Config.tracing``), the worker's half: a call
that carries the driver's trace context (W3C ``traceparent``, mpx/_driver/tracing.py) runs
inside a SERVER span ``mpx.worker <method>``, a child of the driver's span, with
``rpc.system.name``, ``rpc.method`` and ``mpx.rank``; a method that raises sets it to ERROR
(with the exception recorded). The span goes to the tracer provider the worker's process
set up (for example in its ``__init__``); without ``opentelemetry-api`` installed here the
method runs untraced.

Tracing observes a call and never changes it (mpx/_observe.py): what the tracer provider, a
sampler, a span processor (``on_start``, ``on_end``) or the propagator raises is logged once
(to the worker's log) and the method runs, once, as it would untraced; its result or its
own error is the reply. Runs in the RPC loop's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpx._observe import report, run

try:
    from opentelemetry import context, trace
    from opentelemetry.trace import Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # (tracing is optional: the driver sent a context nobody here reads)
    trace = None  # type: ignore[assignment]
except Exception as e:  # (an installation that fails to import: traced, it would fail calls)
    trace = None  # type: ignore[assignment]
    report("tracing: importing opentelemetry", e)

_START = "tracing: starting a call's span (the tracer provider, a sampler, on_start)"
_ENTER = "tracing: making a call's span current"
_LEAVE = "tracing: leaving a call's span"
_FAILED = "tracing: marking a call's span failed"
_END = "tracing: ending a call's span (a span processor's on_end)"


def run_traced(headers: dict[str, str], name: str, rank: int, fn: Callable[..., Any],
               *args: Any) -> Any:
    """``fn(*args)`` inside the call's SERVER span, whose parent the ``headers`` name; what
    ``fn`` returns or raises, whatever tracing raises."""
    if trace is None:
        return fn(*args)
    span = token = None
    try:
        span = trace.get_tracer("mpx").start_span(
            f"mpx.worker {name}", context=TraceContextTextMapPropagator().extract(headers),
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system.name": "mpx", "rpc.method": name, "mpx.rank": rank})
    except Exception as e:
        report(_START, e)
    if span is None:
        return fn(*args)
    try:
        token = context.attach(trace.set_span_in_context(span))
    except Exception as e:
        report(_ENTER, e)
    try:
        return fn(*args)
    except BaseException as e:
        _failed(span, e)
        raise
    finally:
        if token is not None:
            run(_LEAVE, context.detach, token)
        run(_END, span.end)


def _failed(span: Any, error: BaseException) -> None:
    """Mark ``span`` failed by ``error`` (recorded as an event when it is an Exception, as
    OpenTelemetry's own ``use_span`` does)."""
    try:
        span.set_attribute("error.type", type(error).__qualname__)
        if isinstance(error, Exception):
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    except Exception as e:
        report(_FAILED, e)
