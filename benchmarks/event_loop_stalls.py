"""Event-loop stalls: does one large request delay everybody else's answers?

It starts `tinyserve serve` itself (its own process group, a free loopback port)
and keeps three witnesses running for the whole run, each in its own thread:

    /health     polled every 20 ms; the latency of each answer
    a stream    a chat completion that generates for the whole run (a new one when it
                ends); the gap between two of its chunks
    a request   /v1/completions for one token, one after another; its latency, which
                is its first byte

Then it sends, one after the other, requests that a single client may send
(each body under the default 4 MiB limit), and for each reports its status and
time and the witnesses' worst figures while it was in flight. The quiet phase
first is the baseline: the same witnesses with nothing else going on.

    python benchmarks/event_loop_stalls.py [MODEL] [--repeats 1] [--json out.json] [--serve-arg=--max-model-len=512]

MODEL defaults to the built-in model. Figures move with the machine's load, which is
printed at the start and the end; compare each phase with the baseline of the same run.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

MODEL_NAME = "stalls"
FOUR_MB = 4_000_000
QUIET_S = 3.0
SETTLE_S = 0.5  # between two phases, so that one's tail is not counted in the next


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str], log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tinyserve.cli.main", "serve", *([model] if model else []), "--port", str(port),
               "--served-model-name", MODEL_NAME, *extra]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError("the server did not become healthy within 300 s")


def large_requests() -> list[tuple[str, str, bytes]]:
    """(phase, path, body), each body already JSON: encoding it must not stall the witnesses."""
    text = ("The quick brown fox jumps over the lazy dog. " * (FOUR_MB // 45 + 1))[:FOUR_MB]
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(50_000)]
    # 4 MiB of JSON holds about 700,000 small token ids.
    token_ids = [i % 200 + 10 for i in range(700_000)]
    chat = {"model": MODEL_NAME, "max_tokens": 16}
    bodies = [
        ("tokenize a 4 MB prompt", "/tokenize", {"model": MODEL_NAME, "prompt": text}),
        ("tokenize 50,000 messages", "/tokenize", {"model": MODEL_NAME, "messages": many}),
        ("chat with 50,000 messages", "/v1/chat/completions", {**chat, "messages": many}),
        ("complete a 4 MB prompt", "/v1/completions", {**chat, "prompt": text}),
        ("detokenize 700,000 ids", "/detokenize", {"model": MODEL_NAME, "tokens": token_ids}),
        ("chat with 5,000 stop strings", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": "hi"}], "stop": [f"stop-{i:05d}" for i in range(5000)],
          "ignore_eos": True, "max_tokens": 64}),
    ]
    return [(phase, path, json.dumps(body).encode()) for phase, path, body in bodies]


@dataclass
class Witnesses:
    """Three threads that record (began, ended) intervals until `stop` is set: a call, or a gap between chunks."""

    url: str
    stop: threading.Event = field(default_factory=threading.Event)
    health: list = field(default_factory=list)
    stream_gaps: list = field(default_factory=list)
    small: list = field(default_factory=list)
    errors: list = field(default_factory=list)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=target, daemon=True)
                   for target in (self._poll_health, self._stream, self._small_requests)]
        for thread in threads:
            thread.start()
        return threads

    def _poll_health(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                began = time.perf_counter()
                status = self._call(client.get, "/health")
                ended = time.perf_counter()
                self.health.append((began, ended))
                if status != 200:
                    self.errors.append(f"/health answered {status}")
                time.sleep(0.02)

    def _stream(self) -> None:
        # No max_tokens: the rest of the context, as long as this model allows.
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell a long story"}],
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                last = None
                try:
                    with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        for line in response.iter_lines():
                            if not line:
                                continue
                            now = time.perf_counter()
                            if last is not None:
                                self.stream_gaps.append((last, now))
                            last = now
                            if self.stop.is_set():
                                break
                except httpx.HTTPError as error:
                    self.errors.append(f"the stream failed: {type(error).__name__}")
                    if last is not None:
                        self.stream_gaps.append((last, time.perf_counter()))

    def warm_up(self, timeout: float = 120.0) -> None:
        """Wait until every witness has gone round a few times: first requests pay for first-time work."""
        deadline = time.monotonic() + timeout
        while len(self.stream_gaps) < 50 or len(self.small) < 5 or len(self.health) < 20:
            if time.monotonic() > deadline:
                raise RuntimeError("the witnesses did not get going within two minutes")
            time.sleep(0.1)
        time.sleep(1.0)

    def _call(self, method, path: str, **kwargs) -> int | None:
        """The status of one call, or None when it failed (a timeout: the witness waited that long)."""
        try:
            return method(path, **kwargs).status_code
        except httpx.HTTPError as error:
            self.errors.append(f"{path} failed: {type(error).__name__}")
            return None

    def _small_requests(self) -> None:
        body = {"model": MODEL_NAME, "prompt": "Beautiful is", "max_tokens": 1}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                began = time.perf_counter()
                status = self._call(client.post, "/v1/completions", json=body)
                ended = time.perf_counter()
                self.small.append((began, ended))
                if status != 200:
                    self.errors.append(f"a small request answered {status}")
                time.sleep(0.1)


def worst(intervals: list, start: float, end: float) -> tuple[float | None, int]:
    """The longest of the intervals that overlap [start, end], and how many do.

    Overlap, not containment: a /health call stalled by a request is answered just
    after that request, and a stream stalled for the whole phase has no gap inside it."""
    overlapping = [ended - began for began, ended in intervals if began <= end and ended >= start]
    return (max(overlapping) if overlapping else None, len(overlapping))


def run_phases(url: str, repeats: int) -> list[dict]:
    """Send every phase's request in turn; the witnesses' figures are read once they have all stopped,
    since a call the server holds up is only recorded when it is answered, perhaps phases later."""
    witnesses = Witnesses(url)
    threads = witnesses.start()
    rows = []
    try:
        witnesses.warm_up()
        plan = [("quiet (baseline)", None, None)] + large_requests() * repeats
        with httpx.Client(base_url=url, timeout=300) as client:
            for phase, path, body in plan:
                start = time.perf_counter()
                if path is None:
                    time.sleep(QUIET_S)
                    status, size = "-", 0
                else:
                    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
                    status, size = response.status_code, len(response.content)
                end = time.perf_counter()
                rows.append({"phase": phase, "status": status, "seconds": end - start, "response_bytes": size,
                             "start": start, "end": end})
                print(f"  {phase}: {status} in {end - start:.2f} s", file=sys.stderr, flush=True)
                time.sleep(SETTLE_S)
        time.sleep(SETTLE_S)
    finally:
        witnesses.stop.set()
        for thread in threads:
            thread.join(timeout=120)
    for row in rows:
        for name in ("health", "stream_gaps", "small"):
            row[f"{name}_worst_s"], row[f"{name}_count"] = worst(getattr(witnesses, name), row["start"], row["end"])
    if witnesses.errors:
        print("witness errors:", sorted(set(witnesses.errors)))
    return rows


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


HEADER = (f"{'phase':32} {'status':>6} {'took s':>7} {'/health worst ms':>17} {'stream gap ms':>14} "
          f"{'1-token req ms':>15}")


def print_row(row: dict) -> None:
    print(f"{row['phase']:32} {row['status']:>6} {row['seconds']:7.2f} {ms(row['health_worst_s']):>17} "
          f"{ms(row['stream_gaps_worst_s']):>14} {ms(row['small_worst_s']):>15}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="model folder (default: the built-in model)")
    parser.add_argument("--repeats", type=int, default=1, help="send every large request this many times")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `tinyserve serve` flag")
    args = parser.parse_args()

    with tempfile.TemporaryFile(mode="w+") as log:
        process, url = start_server(args.model, args.serve_arg, log)
        try:
            print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
            rows = run_phases(url, args.repeats)
            print(HEADER)
            for row in rows:
                print_row(row)
            print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
