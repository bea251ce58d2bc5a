"""Where speculative decoding stops paying: the built-in model with and without its draft, in one process, at
1, 2, 4, 8, 16 and 32 requests at once. Chapter 6 reads what it writes, traces/spec-decode-sweep.json.

    .venv/bin/python scripts/measure_spec_sweep.py               measure; write traces/spec-decode-sweep.json
    .venv/bin/python scripts/measure_spec_sweep.py --out F.json  write F.json instead

The workload is chapter 6's recorded one: chat turns of PEP 20 (record_traces.ZEN), greedy, 48 tokens
each with ignore_eos, speculated by the built-in draft (record_traces.SPECULATIVE_CONFIG). Each batch size
runs ROUNDS rounds; within a round the two engines take turns, and each keeps its fastest run, so the
first round warms up and a busy moment on the machine falls on both alike. Run it on a quiet machine: the
file records the CPU, its cores, and the load average before and after, which the chapter prints.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, record_traces.py

from recording_servers import SERVER_ENV  # noqa: E402  (imports no torch)

for _name, _value in SERVER_ENV.items():  # before torch: one thread, offline, as the recorded servers run
    os.environ.setdefault(_name, _value)

import record_traces  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))  # roofline.py: how the benchmarks name the CPU
from roofline import cpu_model  # noqa: E402

SWEEP_FILE = ROOT / "traces" / "spec-decode-sweep.json"
CONCURRENCIES = (1, 2, 4, 8, 16, 32)
ROUNDS = 5
MAX_TOKENS = 48


def sweep(concurrencies=CONCURRENCIES, rounds: int = ROUNDS) -> dict:
    """Both engines at each batch size: tokens/s, and the median TTFT and TPOT, of each one's fastest run."""
    import torch

    from tinyserve import LLM, SamplingParams

    load_before = os.getloadavg()[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engines = {"plain": LLM(), "speculative": LLM(speculative_config=record_traces.SPECULATIVE_CONFIG)}
    rows = []
    for concurrency in concurrencies:
        conversations = [[{"role": "user", "content": record_traces.ZEN[i % len(record_traces.ZEN)]}]
                         for i in range(concurrency)]
        fastest = {name: (float("inf"), None) for name in engines}
        for _ in range(rounds):
            for name, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.chat(conversations, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                if elapsed < fastest[name][0]:
                    fastest[name] = (elapsed, outputs)
        for name, (seconds, outputs) in fastest.items():
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            ttft = statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
            tpot = statistics.median((o.metrics.finished_time - o.metrics.first_token_time)
                                     / (len(o.outputs[0].token_ids) - 1) for o in outputs)
            rows.append({"concurrency": concurrency, "engine": name, "tokens": tokens, "seconds": round(seconds, 4),
                         "tokens_per_s": round(tokens / seconds, 1), "ttft_ms_p50": round(ttft * 1e3, 2),
                         "tpot_ms_p50": round(tpot * 1e3, 3)})
    counts = {m.name.split(":")[-1]: m.value for m in engines["speculative"].get_metrics()
              if "spec_decode" in m.name and hasattr(m, "value")}
    return {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_before": round(load_before, 2),
                    "load_after": round(os.getloadavg()[0], 2), "torch": torch.__version__,
                    "python": sys.version.split()[0], "torch_threads": torch.get_num_threads()},
        "workload": {"concurrencies": list(concurrencies), "rounds": rounds, "max_tokens": MAX_TOKENS,
                     "speculative_config": record_traces.SPECULATIVE_CONFIG,
                     "model_fingerprint": record_traces.model_fingerprint()},
        "rows": rows,
        "drafts": {"proposed": counts["spec_decode_num_draft_tokens"],
                   "accepted": counts["spec_decode_num_accepted_tokens"]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=SWEEP_FILE, help="where the JSON goes")
    args = parser.parse_args()
    started = time.monotonic()
    measured = sweep()
    args.out.write_text(json.dumps(measured, indent=1) + "\n")
    for row in measured["rows"]:
        print(f"{row['concurrency']:2d} at once, {row['engine']:<11} {row['tokens_per_s']:7.0f} tokens/s")
    print(f"{args.out} in {time.monotonic() - started:.0f} s; load average {measured['machine']['load_before']} "
          f"before, {measured['machine']['load_after']} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
