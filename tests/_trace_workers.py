"""Workers for tests/test_stats.py's tracing tests: each sets up its own OpenTelemetry tracer
provider whose spans go, one JSON line each, to a file of its rank."""

from __future__ import annotations

import json

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


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
