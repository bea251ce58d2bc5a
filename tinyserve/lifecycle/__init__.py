"""The lifecycle's record: the span schema, tracing set-up, and the span builders that write a run.

    schema            every span name and attribute key, in one place
    tracing           the tracer provider and its exporters, trace context across processes
    request_spans     the API process's spans of a request (render, enqueue, detokenize, respond)
    engine_spans      an engine's spans (queue → prefill → decode, steps), built off its busy loop,
                      with engine_records, ended_spans and timeline_windows
    http_spans        the HTTP server span of every route
    otlp_file         the OTLP-JSON-lines file exporter (otlp_capped: the same, capped in size)

All of it runs while a server runs. Reading a recorded run back (load_run, views, plots,
replay, export to Jaeger or Perfetto, merging the folders of several nodes) is
tinyserve/trace_reading/, which imports this package and nothing else of tinyserve.
"""
