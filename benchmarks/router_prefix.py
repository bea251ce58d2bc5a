"""Prefix-aware routing against round robin: prefix-cache hits and TTFT over two servers.

    .venv/bin/python benchmarks/router_prefix.py [--rounds 2] [--prefixes 4] [--per-prefix 5] [--prefix-chars 1200]

Two `tinyserve serve` ranks of the built-in model (--data-parallel-rank 0 and 1, KV cache
events on, vLLM's metric names, one torch thread each) behind `tinyserve router`, once with
--policy prefix-aware and once with round_robin, fresh servers for each. The workload: P
system prompts of --prefix-chars characters, each asked Q questions, the P x Q chats shuffled and sent
one every --interval seconds (streamed, 8 tokens, greedy). Printed per policy: the prefix-cache
hits the backends counted (vllm:prefix_cache_hits over both), as a share of the ideal (each
prompt's shared blocks computed once: every later chat of a prefix finds them, as /tokenize
counts them), the hit rate over all prompt tokens, and the TTFT the client saw (mean, p50, p90).
Medians over the rounds.
"""

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tinyserve.testing import RouterProcess, ServerProcess, free_port  # noqa: E402

MODEL = "tinyserve-default"
BLOCK_SIZE = 16
ZEN = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
       "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
       "Readability counts.", "Errors should never pass silently.", "Now is better than never.",
       "In the face of ambiguity, refuse the temptation to guess."]


def workload(seed: int, prefixes: int, per_prefix: int, prefix_chars: int) -> list[list[dict]]:
    rng = random.Random(seed)

    def text(num_chars: int) -> str:
        lines = []
        while sum(len(line) + 1 for line in lines) < num_chars:
            lines.append(rng.choice(ZEN))
        return " ".join(lines)

    systems = [f"Reviewer {p} of run {seed}. Judge every answer by these rules: {text(prefix_chars)}" for p in range(prefixes)]
    chats = [[{"role": "system", "content": systems[p]}, {"role": "user", "content": f"Question {q}: {text(60)}"}]
             for p in range(prefixes) for q in range(per_prefix)]
    rng.shuffle(chats)
    return chats


def ideal_hits(url: str, chats: list[list[dict]]) -> int:
    first, ideal = {}, 0
    for messages in chats:
        ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60).json()["tokens"]
        earlier = first.setdefault(messages[0]["content"], ids)
        if earlier is not ids:
            common = next((i for i, (a, b) in enumerate(zip(ids, earlier)) if a != b), min(len(ids), len(earlier)))
            ideal += min(common // BLOCK_SIZE, (len(ids) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    return ideal


def counters(servers) -> tuple[float, float]:
    def total(server, name: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))

    return (sum(total(s, "prefix_cache_hits_total") for s in servers),
            sum(total(s, "prefix_cache_queries_total") for s in servers))


def ttft(url: str, messages: list[dict]) -> float:
    """Seconds from sending the chat to its first content chunk, streamed."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - start
                for _ in lines:  # the rest of the answer, as a client would read it
                    pass
                return first
    raise RuntimeError(f"no content in the answer ({response.status_code})")


def one_run(policy: str, seed: int, args) -> dict:
    port = free_port()
    while True:  # rank 1 publishes on port + 1
        try:
            with __import__("socket").socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})
    env = {"OMP_NUM_THREADS": "1"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(lambda rank: ServerProcess(
            None, "--data-parallel-size", "2", "--data-parallel-rank", str(rank), "--kv-events-config", events,
            "--metrics-prefix", "vllm", "--max-num-seqs", "4", startup_timeout=300, env=env), (0, 1)))
    flags = ["--policy", "round_robin"] if policy == "round_robin" else [
        "--policy", "prefix-aware", "--kv-events", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"]
    router = RouterProcess([s.url for s in servers], *flags)
    try:
        for server in servers:  # warm up each engine's kernels, outside the figures
            httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Warm up.", "max_tokens": 2},
                       timeout=300).raise_for_status()
        chats = workload(seed, args.prefixes, args.per_prefix, args.prefix_chars)
        ideal = ideal_hits(servers[0].url, chats)
        hits0, queries0 = counters(servers)
        with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
            futures = []
            for messages in chats:
                futures.append(pool.submit(ttft, router.url, messages))
                time.sleep(args.interval)
            ttfts = [f.result() for f in futures]
        hits, queries = counters(servers)
    finally:
        router.stop()
        for server in servers:
            server.stop()
    ttfts.sort()
    return {"share": (hits - hits0) / ideal, "rate": (hits - hits0) / (queries - queries0),
            "ttft_mean": statistics.mean(ttfts), "ttft_p50": ttfts[len(ttfts) // 2],
            "ttft_p90": ttfts[int(len(ttfts) * 0.9)], "hits": hits - hits0, "ideal": ideal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=5)
    parser.add_argument("--prefix-chars", type=int, default=1200,
                        help="characters of each system prompt (default 1200, ~380 tokens)")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between two chats (default 0.05)")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
    results = {policy: [] for policy in ("prefix-aware", "round_robin")}
    for round_ in range(args.rounds):
        for policy in results:
            results[policy].append(one_run(policy, seed=round_, args=args))
            print(f"round {round_} {policy}: {results[policy][-1]}", flush=True)
    print(f"\n{'policy':<14}{'hits / ideal':>14}{'hit rate':>10}{'TTFT mean':>11}{'p50':>8}{'p90':>8}  (medians over "
          f"{args.rounds} rounds)")
    for policy, runs in results.items():
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{policy:<14}{med['share']:>13.1%}{med['rate']:>10.1%}{med['ttft_mean'] * 1e3:>9.0f}ms"
              f"{med['ttft_p50'] * 1e3:>6.0f}ms{med['ttft_p90'] * 1e3:>6.0f}ms")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
