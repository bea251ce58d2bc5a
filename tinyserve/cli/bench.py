"""`tinyserve bench throughput` and `tinyserve bench serve`: vLLM's two benchmarks.

    tinyserve bench throughput [MODEL] --num-prompts 32 --input-len 128 --output-len 64
        offline: an LLM in this process generates for every prompt at once

    tinyserve bench serve --base-url http://127.0.0.1:8000 --endpoint /v1/completions \\
        --num-prompts 100 --request-rate 4 --burstiness 1 --max-concurrency 16
        online: streamed requests against a running OpenAI-compatible server

Bad arguments end the command with one line on stderr and exit code 2; a server that
cannot be reached or refuses the test request, with exit code 1.
"""

import argparse
import json
import math
import os
import pathlib
import sys

from tinyserve.bench.request_funcs import COMPLETIONS, ENDPOINTS
from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="benchmark throughput offline or a running server",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _add_throughput_parser(benchmarks)
    _add_serve_parser(benchmarks)


def _add_throughput_parser(benchmarks) -> None:
    parser = benchmarks.add_parser("throughput", help="offline throughput of an LLM in this process",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)  # --seed seeds the dataset as well as the sampler
    group = parser.add_argument_group("benchmark")
    group.add_argument("--num-prompts", type=int, default=1000, help="number of requests (default 1000)")
    group.add_argument("--input-len", type=int, default=1024, help="mean prompt length in tokens (default 1024)")
    group.add_argument("--output-len", type=int, default=128, help="mean output length in tokens (default 128)")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="lengths are uniform in [L*(1-R), L*(1+R)], 0 <= R < 1 (default 0: all equal)")
    group.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0, as vLLM)")
    group.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="let requests end at end-of-sequence (default: generate exactly the output length)")
    group.add_argument("--output-json", default=None, help="also write the results and the configuration here")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_throughput)


def _add_serve_parser(benchmarks) -> None:
    parser = benchmarks.add_parser("serve", help="latency and throughput of a running OpenAI-compatible server",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's root URL (default http://127.0.0.1:8000)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default=COMPLETIONS,
                        help="the API to call (default /v1/completions)")
    parser.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    parser.add_argument("--tokenizer", default=None,
                        help="a local folder with the model's tokenizer (default: the model's folder if local, "
                             "else the server's /tokenize and /detokenize)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="the server's --api-key (default: $OPENAI_API_KEY, else none)")
    dataset = parser.add_argument_group("random dataset")
    dataset.add_argument("--num-prompts", type=int, default=1000, help="number of requests (default 1000)")
    dataset.add_argument("--random-input-len", type=int, default=1024, help="mean prompt length (default 1024)")
    dataset.add_argument("--random-output-len", type=int, default=128, help="mean max_tokens (default 128)")
    dataset.add_argument("--random-range-ratio", type=float, default=0.0,
                         help="lengths are uniform in [L*(1-R), L*(1+R)], 0 <= R < 1 (default 0)")
    dataset.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times (default 0)")
    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second, or inf to send them all at once (default inf)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, "
                           "lower is burstier, higher more regular (default 1)")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    load.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    report = parser.add_argument_group("report")
    report.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                        help="service-level objectives, e.g. ttft:200 tpot:50 e2el:2000; goodput counts the "
                             "requests meeting all of them")
    report.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                        help="which latencies to report: a subset of ttft,tpot,itl,e2el (default ttft,tpot,itl)")
    report.add_argument("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99 (default 99)")
    report.add_argument("--save-result", action="store_true", help="write the results as JSON")
    report.add_argument("--result-dir", default=".", help="where --save-result writes (default: here)")
    report.add_argument("--result-filename", default=None,
                        help="file name for --save-result (default openai-{rate}qps-{model}-{date}.json)")
    report.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_serve)


def run_throughput(args: argparse.Namespace) -> int:
    from tinyserve.bench.throughput import ThroughputConfig, benchmark_throughput

    config = ThroughputConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                              range_ratio=args.range_ratio, seed=args.seed, ignore_eos=args.ignore_eos,
                              temperature=args.temperature)
    try:
        config.validate()
        engine_args = engine_args_from(args)
        result = benchmark_throughput(config, engine_args, use_tqdm=not args.disable_tqdm)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.format())
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(result.to_json(config, engine_args), indent=2) + "\n")
        print(f"Results written to {args.output_json}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from tinyserve.bench.serve import ServeConfig, benchmark_serve, describe_load, save_result

    config = ServeConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model, tokenizer=args.tokenizer,
        num_prompts=args.num_prompts, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos, temperature=args.temperature, goodput=args.goodput,
        percentile_metrics=args.percentile_metrics, metric_percentiles=args.metric_percentiles, seed=args.seed,
        api_key=args.api_key, disable_tqdm=args.disable_tqdm,
    )
    try:
        config.validate()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(describe_load(config), flush=True)
    try:
        result = benchmark_serve(config)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(result.format())
    if args.save_result:
        path = pathlib.Path(args.result_dir) / (args.result_filename or result.default_filename())
        path.parent.mkdir(parents=True, exist_ok=True)
        save_result(result, path)
        print(f"Results written to {path}")
    return 0
