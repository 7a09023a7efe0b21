"""Workers for the tracing tests (tests/observe/test_stats.py, tests/observe/test_observers.py): each sets up
its own OpenTelemetry tracer provider whose spans go, one JSON line each, to a file of its
rank; ``RaisingSpans`` adds a span processor whose hooks raise, and logs mpx's log records to
a file of its rank."""

from __future__ import annotations

import json
import logging

from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class HookError(Exception):
    """What the raising span processors raise."""


class RaisingProcessor(SpanProcessor):
    """A span processor whose ``on_start`` and/or ``on_end`` raise HookError while on."""

    def __init__(self, hooks=("on_start", "on_end")) -> None:
        self.hooks = set(hooks)
        self.on = True

    def on_start(self, span, parent_context=None):
        if self.on and "on_start" in self.hooks:
            raise HookError(f"on_start of {span.name}")

    def on_end(self, span):
        if self.on and "on_end" in self.hooks:
            raise HookError(f"on_end of {span.name}")


class _FileExporter(SpanExporter):
    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans):
        with open(self.path, "a") as f:
            for s in spans:
                parent = s.parent
                f.write(json.dumps({
                    "name": s.name, "kind": s.kind.name, "trace_id": s.context.trace_id,
                    "span_id": s.context.span_id,
                    "parent_id": parent.span_id if parent is not None else None,
                    "attributes": dict(s.attributes), "status": s.status.status_code.name,
                }) + "\n")
        return SpanExportResult.SUCCESS


class Traced:
    def __init__(self, ctx, out_dir: str) -> None:
        self.rank = ctx.rank
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_FileExporter(f"{out_dir}/{ctx.rank}.jsonl")))
        trace.set_tracer_provider(provider)

    def work(self, x):
        return x + self.rank

    def boom(self):
        raise KeyError("no such thing")


class RaisingSpans(Traced):
    """Traced, with a span processor (added before the exporting one) whose ``hooks`` raise;
    mpx's log records go to ``<out_dir>/<rank>.log``."""

    def __init__(self, ctx, out_dir: str, hooks=("on_start", "on_end")) -> None:
        handler = logging.FileHandler(f"{out_dir}/{ctx.rank}.log")
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logging.getLogger("mpx").addHandler(handler)
        provider = TracerProvider()
        provider.add_span_processor(RaisingProcessor(hooks))
        provider.add_span_processor(SimpleSpanProcessor(_FileExporter(f"{out_dir}/{ctx.rank}.jsonl")))
        trace.set_tracer_provider(provider)
        self.rank = ctx.rank
