"""The test process's one OpenTelemetry SDK tracer provider: OpenTelemetry lets a process set
its global provider once, so every suite adds its span processors to this one."""

from __future__ import annotations


def provider():
    """The process's SDK ``TracerProvider``, set as the global one on first use."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        current = trace.get_tracer_provider()
    assert isinstance(current, TracerProvider), "another global tracer provider was set"
    return current
