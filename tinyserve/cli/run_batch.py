"""`tinyserve run-batch -i IN.jsonl -o OUT.jsonl [MODEL]`: an OpenAI Batch file, offline.

Each input line is one request (blank lines are skipped; line numbers in errors count them):

    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Each output line answers the request at the same position (the n-th non-blank
input line), in the record shape of OpenAI's Batch API:

    the endpoint answered (any status)  {"id": "batch_req_…", "custom_id": "a",
                                         "response": {"status_code": 200, "request_id": "chatcmpl-…",
                                                      "body": <the endpoint's JSON: result or error object>},
                                         "error": null}
    the line could not be sent          {"id": "batch_req_…", "custom_id": "a" or null,
                                         "response": null,
                                         "error": {"code": "invalid_json_line", "message": "…"}}

The engine runs in this process, and every body goes through the very FastAPI
app that `tinyserve serve` runs, over an in-memory ASGI transport (no socket),
so validation, defaults and response bodies are exactly the server's. All lines
are in flight together, so the scheduler batches them like concurrent clients.

With --enable-metrics (vLLM's flags), the server's Prometheus metrics are served at
http://HOST:PORT/metrics (--host, default 127.0.0.1; --port, default 8000) while the batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from
from tinyserve.cli.lora_flags import add_lora_modules_flag, lora_registry_from
from tinyserve.cli.metrics_flags import add_metrics_flags
from tinyserve.cli.vllm_flags import add_chat_template_flag, load_chat_template

if TYPE_CHECKING:  # imported where used: `tinyserve run-batch --help` loads none of the server
    import httpx

# As vLLM's run-batch; /v1/embeddings is answered by an engine started with --runner pooling (else a 400 per line).
SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
REQUIRED_FIELDS = ("custom_id", "method", "url", "body")


def add_parser(commands) -> None:
    parser = commands.add_parser("run-batch", help="run an OpenAI Batch file (JSONL) through the engine",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input-file", required=True, help="the batch file, one request per line ('-': stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="where the results go, one per line ('-': stdout)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) the bodies' 'model' may use (default: the model argument, or 'tinyserve-default')")
    add_engine_flags(parser)
    add_lora_modules_flag(parser)  # a line's model may name one of them, as a server's request's may
    add_chat_template_flag(parser)
    add_metrics_flags(parser)
    metrics = parser.add_argument_group("metrics while the batch runs (vLLM's run-batch flags)")
    metrics.add_argument("--enable-metrics", action="store_true",
                         help="serve the Prometheus metrics at http://HOST:PORT/metrics while the batch runs")
    metrics.add_argument("--host", "--url", dest="host", default="127.0.0.1",
                         help="the metrics server's address (default 127.0.0.1; --url is vLLM's older name)")
    metrics.add_argument("--port", type=int, default=8000, help="the metrics server's port (default 8000; 0: any free one)")
    parser.set_defaults(handler=run)


# ---- one line: parse it, send it, shape the record ---------------------------------


class BatchLineError(Exception):
    """A line that cannot be sent to an endpoint; becomes a record with "response": null."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.custom_id = custom_id


@dataclass(slots=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict


def parse_line(line: str) -> BatchRequest:
    """Check one input line; raise BatchLineError with OpenAI's batch error codes."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as error:
        raise BatchLineError("invalid_json_line", f"the line is not valid JSON: {error}") from None
    if not isinstance(request, dict):
        raise BatchLineError("invalid_json_line", f"the line must be a JSON object, got {type(request).__name__}")
    custom_id = request.get("custom_id")
    custom_id = custom_id if isinstance(custom_id, str) else None
    missing = [field for field in REQUIRED_FIELDS if field not in request]
    if missing:
        raise BatchLineError("missing_required_parameter", f"the line lacks {', '.join(missing)}", custom_id)
    if custom_id is None:
        raise BatchLineError("invalid_parameter", "custom_id must be a string", None)
    if request["method"] != "POST":
        raise BatchLineError("invalid_method", f"method must be 'POST', got {request['method']!r}", custom_id)
    if request["url"] not in SUPPORTED_URLS:
        raise BatchLineError("invalid_url", f"url must be one of {list(SUPPORTED_URLS)}, got {request['url']!r}", custom_id)
    body = request["body"]
    if not isinstance(body, dict):
        raise BatchLineError("invalid_parameter", f"body must be a JSON object, got {type(body).__name__}", custom_id)
    if body.get("stream"):
        raise BatchLineError("invalid_parameter", "body.stream: a batch answers with whole responses; "
                             "remove 'stream' or set it to false", custom_id)
    return BatchRequest(custom_id, request["url"], body)


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def error_record(error: BatchLineError) -> dict:
    return {"id": _record_id(), "custom_id": error.custom_id, "response": None,
            "error": {"code": error.code, "message": error.message}}


def response_record(custom_id: str, status_code: int, body) -> dict:
    # The endpoint's own id ("chatcmpl-…") is the one the engine, logs and traces know the
    # request by; an error body has none, so it gets a fresh one.
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return {"id": _record_id(), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id or f"req_{uuid.uuid4().hex}", "body": body},
            "error": None}


async def answer_line(client: httpx.AsyncClient, line: str, number: int) -> dict:
    """The output record for input line `number`; never raises for a bad line."""
    try:
        request = parse_line(line)
    except BatchLineError as error:
        error.message = f"line {number}: {error.message}"
        return error_record(error)
    response = await client.post(request.url, json=request.body)
    try:
        body = response.json()
    except ValueError:  # an unhandled exception in the app answers plain text
        from tinyserve.entrypoints.api.errors import openai_error_body

        body = openai_error_body(response.status_code, response.text)
    return response_record(request.custom_id, response.status_code, body)


# ---- the whole file ----------------------------------------------------------------


async def run_batch(app, lines: list[tuple[int, str]], out: TextIO, max_in_flight: int) -> None:
    """Send every (line number, line) through `app` concurrently; write the records in input order."""
    # raise_app_exceptions=False: a crash inside one request answers 500 for that line
    # instead of ending the batch.
    import httpx
    from tqdm import tqdm

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    slots = asyncio.Semaphore(max_in_flight)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:
        with tqdm(total=len(lines), unit="req", desc="run-batch", file=sys.stderr) as progress:

            async def answer(number: int, line: str) -> dict:
                async with slots:
                    record = await answer_line(client, line, number)
                progress.update()
                return record

            tasks = [asyncio.create_task(answer(number, line)) for number, line in lines]
            # Awaiting in input order writes each record as soon as all earlier ones are done.
            for task in tasks:
                out.write(json.dumps(await task, ensure_ascii=False) + "\n")
                out.flush()


def _read_lines(path: str) -> list[tuple[int, str]]:
    """The non-blank lines, with their line numbers (from 1). A line ends at "\\n" only, as a JSON Lines reader's:
    str.splitlines would also break at U+0085 or U+2028 inside a prompt, where JSON may leave them unescaped."""
    text = sys.stdin.read() if path == "-" else pathlib.Path(path).read_text(encoding="utf-8")
    return [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]


def _unwritable(path: str) -> str | None:
    """Why `path` could not be written, checked without touching it: an existing file's
    records stay until the model has loaded and the batch can run."""
    target = pathlib.Path(path)
    if target.is_dir():
        return "it is a directory"
    if target.exists():
        return None if os.access(target, os.W_OK) else "permission denied"
    parent = target.parent
    if not parent.is_dir():
        return f"no directory {parent}"
    return None if os.access(parent, os.W_OK) else f"permission denied in {parent}"


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    try:
        lines = _read_lines(args.input_file)
    except (OSError, UnicodeDecodeError) as error:
        print(f"error: cannot read the input file {args.input_file}: {error}", file=sys.stderr)
        return 1
    problem = None if args.output_file == "-" else _unwritable(args.output_file)
    if problem is not None:
        print(f"error: cannot write the output file {args.output_file}: {problem}", file=sys.stderr)
        return 1
    return _run_with_engine(args, lines)


def _open_output(path: str) -> TextIO:
    return sys.stdout if path == "-" else open(path, "w", encoding="utf-8")


def _run_with_engine(args: argparse.Namespace, lines: list[tuple[int, str]]) -> int:
    from tinyserve.frontend.async_llm import AsyncLLM
    from tinyserve.entrypoints.api.metrics import ServerMetrics
    from tinyserve.entrypoints.api.serving_engine import ServingContext
    from tinyserve.entrypoints.api.server import build_app

    names = args.served_model_name or [args.model or "tinyserve-default"]
    try:
        engine_args = engine_args_from(args)
        engine = AsyncLLM(engine_args, in_process=True)
        loras = lora_registry_from(args, engine_args, engine.model_info.path, names[0])
    except (ValueError, OSError) as error:
        print(f"error: cannot load the model: {error}", file=sys.stderr)
        return 1
    if args.chat_template is not None:
        engine.tokenizer.chat_template = args.chat_template
    metrics = ServerMetrics(names[0], engine.engine_indices, engine.model_info.max_model_len,
                            prefix=args.metrics_prefix)
    if args.enable_metrics:
        from prometheus_client import start_http_server

        try:
            metrics_server, _ = start_http_server(args.port, addr=args.host, registry=metrics.registry)
        except OSError as error:
            print(f"error: cannot serve metrics on {args.host}:{args.port}: {error.strerror or error}", file=sys.stderr)
            return 2
        print(f"tinyserve: metrics at http://{args.host}:{metrics_server.server_port}/metrics", file=sys.stderr,
              flush=True)
    app = build_app(ServingContext(engine, names, loras=loras), metrics)
    print(f"tinyserve: {len(lines)} requests from {args.input_file} to {names[0]} ({engine.model_info.path})",
          file=sys.stderr, flush=True)

    async def main() -> None:
        # The app's lifespan starts and stops the engine (ASGITransport does not run it).
        async with app.router.lifespan_context(app):
            # Opened (and so emptied) only now that the model has loaded.
            out = _open_output(args.output_file)
            try:
                # As vLLM's run_batch: enough in flight to fill every seat, twice over.
                await run_batch(app, lines, out, max_in_flight=2 * engine_args.max_num_seqs)
            finally:
                if out is not sys.stdout:
                    out.close()

    try:
        asyncio.run(main())
    except (ValueError, OSError) as error:  # the engine could not start, or the output could not be written
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("run-batch: interrupted; the output file holds the records written so far", file=sys.stderr)
        return 130
    return 0
