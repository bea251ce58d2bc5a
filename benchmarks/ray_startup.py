"""Start-up with Ray as the distributed backend, beside the default processes: seconds to /health.

    .venv/bin/python benchmarks/ray_startup.py [--rounds 3]

Each contender is a fresh `tinyserve serve` of bench_models.py's ~27M-parameter Llama, timed
from its launch until /health answers 200 (tinyserve.testing.ServerProcess):

    DP=2 mp                         two engine processes (the default)
    DP=2 ray, new local cluster     --data-parallel-backend ray, no cluster to join: the server starts one
    DP=2 ray, cluster up            the same, joining a Ray cluster already running (RAY_ADDRESS)
    TP=2 mp                         rank 1 a child process of the engine (the default)
    TP=2 ray, new local cluster     --distributed-executor-backend ray: rank 1 a Ray actor

Contenders alternate within each round; the table prints each one's median over the rounds
and the load average before and after. Ray's nodes are kept on loopback
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import bench_models  # noqa: E402
from tinyserve.testing import ServerProcess  # noqa: E402

ENGINE = ("--num-kv-blocks", "256")
CONTENDERS = {
    "DP=2 mp": (("--data-parallel-size", "2"), False),
    "DP=2 ray, new local cluster": (("--data-parallel-size", "2", "--data-parallel-backend", "ray"), False),
    "DP=2 ray, cluster up": (("--data-parallel-size", "2", "--data-parallel-backend", "ray"), True),
    "TP=2 mp": (("--tensor-parallel-size", "2"), False),
    "TP=2 ray, new local cluster": (("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"), False),
}


def time_to_health(model: str, flags: tuple, ray_address: str | None) -> float:
    env = {"RAY_ADDRESS": ray_address} if ray_address else {}
    saved = os.environ.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    try:
        server = ServerProcess(model, *ENGINE, *flags, startup_timeout=300, env=env)
    finally:
        if saved is not None:
            os.environ["RAY_ADDRESS"] = saved
    seconds = time.monotonic() - started
    server.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    with tempfile.TemporaryDirectory() as folder:
        model = str(Path(folder) / "model")
        bench_models.build_model(model, bench_models.FULL, quick=False)
        load_before = os.getloadavg()[0]
        times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        for round_ in range(args.rounds):
            for name, (flags, joins) in CONTENDERS.items():
                cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}) \
                    if joins else None  # up before the server starts; none otherwise, so the server starts its own
                try:
                    times[name].append(time_to_health(model, flags, cluster.address if joins else None))
                finally:
                    if cluster is not None:
                        cluster.shutdown()
                print(f"round {round_ + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
        print(f"\nload average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
              f"{os.cpu_count()} cores, {args.rounds} rounds\n")
        print("| contender | seconds to /health (median) | runs |\n|---|---|---|")
        for name, values in times.items():
            print(f"| {name} | {statistics.median(values):.1f} | {', '.join(f'{v:.1f}' for v in values)} |")


if __name__ == "__main__":
    main()
