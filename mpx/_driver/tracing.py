"""OpenTelemetry tracing of collective calls (``Config.tracing``), the driver's half.

Each ``collective_rpc`` runs inside a span ``mpx.collective_rpc <method>`` of kind CLIENT, a
child of the caller's current span, with ``rpc.system.name = "mpx"``, ``rpc.method`` and
``mpx.world_size``; a call that fails sets its status to ERROR and ``error.type``. Its
context travels with the call as W3C trace-context headers (``traceparent``), from which each
worker makes its SERVER span (mpx/_worker/tracing.py). A non-blocking call's span ends when
its future completes (in the thread that runs the future's done callbacks, outside every mpx
lock).

Tracing observes a call and never changes it (mpx/_observe.py): what the tracer provider, a
sampler, a span processor (``on_start``, ``on_end``) or the propagator raises is logged once
and the call goes on, without its span if the span could not start (the workers then trace
it without a parent). Each step is guarded on its own, so a span that started always ends.

Only imported when tracing is on and ``opentelemetry-api`` is installed (``available()``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from mpx._observe import report, run

_START = "tracing: starting a call's span (the tracer provider, a sampler, on_start)"
_ENTER = "tracing: making a call's span current (its context, the propagator)"
_LEAVE = "tracing: leaving a call's span"
_FAILED = "tracing: marking a call's span failed"
_END = "tracing: ending a call's span (a span processor's on_end)"


def available() -> bool:
    """Whether ``opentelemetry-api`` can be imported here (False, with why logged, when
    looking for it raises: finding ``opentelemetry.trace`` imports ``opentelemetry``)."""
    try:
        return importlib.util.find_spec("opentelemetry") is not None and \
            importlib.util.find_spec("opentelemetry.trace") is not None
    except Exception as e:
        report("tracing: looking for opentelemetry", e)
        return False


def traced_call(call: Callable[[dict[str, str]], Any], name: str, world_size: int,
                non_block: bool) -> Any:
    """``call(headers)`` inside the call's CLIENT span; its result (a future's span ends
    when the future completes). ``call``'s outcome is the only one: no error of tracing
    reaches the caller."""
    headers: dict[str, str] = {}
    span = token = None
    try:
        span = _start(name, world_size)
    except Exception as e:
        report(_START, e)
    if span is not None:
        try:
            token = _enter(span, headers)
        except Exception as e:
            report(_ENTER, e)
    try:
        out = call(headers)
    except BaseException as e:
        if span is not None:
            _leave(token)
            _end(span, e)
        raise
    if span is not None:
        _leave(token)
        if non_block:
            out.add_done_callback(lambda fut: _end(span, fut.exception()))
        else:
            _end(span, None)
    return out


def _start(name: str, world_size: int) -> Any:
    from opentelemetry import trace

    return trace.get_tracer("mpx").start_span(
        f"mpx.collective_rpc {name}", kind=trace.SpanKind.CLIENT,
        attributes={"rpc.system.name": "mpx", "rpc.method": name,
                    "mpx.world_size": world_size})


def _enter(span: Any, headers: dict[str, str]) -> Any:
    """Make ``span`` the current one; its context into ``headers``. The context's token."""
    from opentelemetry import context, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = trace.set_span_in_context(span)
    TraceContextTextMapPropagator().inject(headers, context=ctx)
    return context.attach(ctx)


def _leave(token: Any) -> None:
    if token is not None:
        from opentelemetry import context

        run(_LEAVE, context.detach, token)


def _end(span: Any, error: BaseException | None) -> None:
    if error is not None:
        try:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
            span.set_attribute("error.type", type(error).__qualname__)
        except Exception as e:
            report(_FAILED, e)
    run(_END, span.end)
