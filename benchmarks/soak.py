"""Soak: a traced server under a steady stream of requests, some dropped mid-way, some malformed.

It starts `tinyserve serve --trace` itself (its own process group, a free
loopback port), sends `--rate` requests a second for `--duration` seconds, a
mix of chat, completions and Anthropic messages, streamed or not, with
`--disconnect-fraction` of streams dropped after a few events and
`--bad-fraction` malformed requests. Then it checks what a long-running server
must keep true:

    no 5xx (a 503 with Retry-After under overload is counted apart, not a failure)
    every request answered as it should be: completed, refused with a 4xx if bad
    afterwards idle: no request running or waiting, no KV block in use
    memory: RSS of the API process and of each engine, at the start and the end
    SIGTERM: every process of the server gone, the socket directory removed
    the trace: every line parses; every request trace has its HTTP root span,
    and every answered generation request its request span

    python benchmarks/soak.py [MODEL] [--duration 60] [--rate 4] [--json report.json] [--serve-arg=--num-kv-blocks=256]

MODEL defaults to the built-in model. Exit status 0 when every check holds.
"""

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import psutil

from tinyserve.lifecycle import schema
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans

MODEL_NAME = "soak"
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
BAD_REQUESTS = [  # (path, JSON body or raw bytes): each must be refused with a 4xx
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "", "content": "x"}]}),  # an empty role
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "top_k": 2**63 + 1}),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "n": 0}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 10**9]}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", b'{"model": "soak", "prompt": "\\ud800"}'),
    ("/v1/messages", {"model": MODEL_NAME, "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
    ("/v1/messages", b"{not json"),
    ("/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000),
]


def rss_by_process(pid: int) -> dict[str, int]:
    """Resident memory of the API process and of each of its children (engines), by '<name> <pid>'."""
    root = psutil.Process(pid)
    result = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = "api" if process.pid == pid else process.name()
            result[f"{name} {process.pid}"] = process.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return result


def good_request(rng: random.Random, index: int, max_tokens: int, stream: bool) -> tuple[str, dict]:
    words = f"request {index} says " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(6))
    kind = rng.choice(GENERATION_PATHS)
    common = {"model": MODEL_NAME, "max_tokens": max_tokens, "stream": stream}
    if kind == "/v1/completions":
        return kind, {**common, "prompt": words, "ignore_eos": True}
    if kind == "/v1/messages":
        return kind, {**common, "messages": [{"role": "user", "content": words}]}
    return kind, {**common, "messages": [{"role": "user", "content": words}], "ignore_eos": True}


def stream_ended_properly(path: str, lines: list[str]) -> bool:
    if path == "/v1/messages":
        return "event: message_stop" in lines
    return bool(lines) and lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)


async def one_request(client: httpx.AsyncClient, rng: random.Random, index: int, args) -> str:
    """Send one request; return its outcome: 'completed', 'bad_refused', 'disconnected', 'overloaded' or 'failed: …'."""
    roll = rng.random()
    if roll < args.bad_fraction:
        path, body = rng.choice(BAD_REQUESTS)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await client.post(path, content=content, headers={"Content-Type": "application/json"})
        return "bad_refused" if 400 <= response.status_code < 500 else f"failed: bad request answered {response.status_code}"
    disconnect = roll < args.bad_fraction + args.disconnect_fraction
    stream = disconnect or rng.random() < args.stream_fraction
    path, body = good_request(rng, index, args.max_tokens * (20 if disconnect else 1), stream)
    if not stream:
        response = await client.post(path, json=body)
        if response.status_code == 503 and "retry-after" in response.headers:
            return "overloaded"
        if response.status_code != 200:
            return f"failed: {response.status_code} {response.text[:200]}"
        return "completed"
    events_to_read = rng.randint(0, 3)
    async with client.stream("POST", path, json=body) as response:
        if response.status_code == 503 and "retry-after" in response.headers:
            return "overloaded"
        if response.status_code != 200:
            return f"failed: {response.status_code}"
        lines = []
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
            if disconnect and len(lines) > events_to_read:
                return "disconnected"  # leaving the block closes the connection mid-stream
    return "completed" if stream_ended_properly(path, lines) else f"failed: stream ended without its last event: {lines[-2:]}"


async def run_load(url: str, args) -> tuple[collections.Counter, int]:
    outcomes: collections.Counter = collections.Counter()
    num_requests = max(1, int(args.duration * args.rate))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        async def timed(index: int) -> None:
            await asyncio.sleep(index / args.rate)  # a fixed rate, whatever the answers take
            try:
                outcome = await one_request(client, random.Random(f"{args.seed}-{index}"), index, args)
            except httpx.HTTPError as error:
                outcome = f"failed: {type(error).__name__}: {error}"
            outcomes[outcome[:300]] += 1
        await asyncio.gather(*[timed(i) for i in range(num_requests)])
    return outcomes, num_requests


def metrics(url: str) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            if line.startswith(f"tinyserve:{name}{{"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return dict(totals)


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(url)
        if not any(now.values()) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def check_trace(run_dir: Path) -> dict:
    """Every line parses; every request trace has one HTTP root, and a request span when it was answered 200.

    The roots' status codes also count what the server answered, clients that left included.
    """
    unparseable = 0
    for path in run_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                json.loads(line)
            except ValueError:
                unparseable += 1
    spans = [span for path in sorted(run_dir.glob("*.jsonl")) for span in read_spans(path)]
    traces = collections.defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    request_traces = [ss for ss in traces.values() if not any(s.name == schema.STEP for s in ss)]
    missing_root, missing_request_span = 0, 0
    statuses: collections.Counter = collections.Counter()
    for trace_spans in request_traces:
        ids = {s.span_id for s in trace_spans}
        roots = [s for s in trace_spans if s.parent_span_id not in ids]
        if len(roots) != 1 or not roots[0].name.startswith("POST /v1/"):
            missing_root += 1
            continue
        status = roots[0].attributes.get("http.response.status_code")
        statuses[status] += 1
        answered = status == 200
        if answered and roots[0].name.split(" ", 1)[1] in GENERATION_PATHS and not any(
                s.name.startswith((f"{schema.OPERATION_CHAT} ", f"{schema.OPERATION_TEXT_COMPLETION} ")) for s in trace_spans):
            missing_request_span += 1
    return {"request_traces": len(request_traces), "unparseable_lines": unparseable,
            "traces_missing_root": missing_root, "traces_missing_request_span": missing_request_span,
            "http_statuses": {str(status): count for status, count in sorted(statuses.items())}}


def soak(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="tinyserve-soak-"))
    trace_dir = Path(args.trace_dir) if args.trace_dir else workdir / "traces"
    server = ServerProcess(args.model, "--served-model-name", MODEL_NAME, "--trace", "--trace-dir", str(trace_dir),
                           *args.serve_arg, startup_timeout=300, log_path=workdir / "server.log")
    report: dict = {"duration_s": args.duration, "rate_per_s": args.rate, "server_log": str(workdir / "server.log")}
    try:
        report["rss_start"] = rss_by_process(server.process.pid)
        started = time.monotonic()
        outcomes, report["requests_sent"] = asyncio.run(run_load(server.url, args))
        report["load_seconds"] = round(time.monotonic() - started, 1)
        report["outcomes"] = dict(outcomes)
        report["idle_after"] = wait_idle(server.url)
        report["rss_end"] = rss_by_process(server.process.pid)
    finally:
        stop_started = time.monotonic()
        server.stop(timeout=120)
    report["shutdown_seconds"] = round(time.monotonic() - stop_started, 1)
    report["processes_left"] = not server.group_is_gone()
    [run_dir] = list(trace_dir.iterdir())
    report["trace"] = {"run_dir": str(run_dir), **check_trace(run_dir)}
    statuses = report["trace"]["http_statuses"]
    report["http_5xx"] = sum(count for status, count in statuses.items() if int(status) >= 500 and status != "503")
    report["failures"] = {k: v for k, v in report["outcomes"].items() if k.startswith("failed")}
    trace = report["trace"]
    report["ok"] = (not report["failures"] and report["http_5xx"] == 0 and not any(report["idle_after"].values())
                    and not report["processes_left"] and trace["unparseable_lines"] == 0
                    and trace["traces_missing_root"] == 0 and trace["traces_missing_request_span"] == 0
                    and trace["request_traces"] == report["requests_sent"])
    if report["ok"] and not args.trace_dir:
        shutil.rmtree(workdir, ignore_errors=True)  # kept, with the server's log, when a check failed
        report["trace"]["run_dir"] = report["server_log"] = None
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completed request (default 16)")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1, help="streams dropped mid-way (default 0.1)")
    parser.add_argument("--bad-fraction", type=float, default=0.1, help="malformed requests (default 0.1)")
    parser.add_argument("--stream-fraction", type=float, default=0.5, help="of the rest, streamed (default 0.5)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request, seconds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    parser.add_argument("--trace-dir", default=None, help="keep the trace here (default: a temporary folder)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra flag for `tinyserve serve` (repeatable)")
    parser.add_argument("--json", default=None, help="also write the report here")
    args = parser.parse_args()
    if args.rate <= 0 or args.duration <= 0:
        parser.error("--rate and --duration must be positive")
    if not 0 <= args.bad_fraction + args.disconnect_fraction <= 1:
        parser.error("--bad-fraction + --disconnect-fraction must be in [0, 1]")
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
