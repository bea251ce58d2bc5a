"""What structured outputs cost: constrained against free decoding, and compiling a grammar per schema.

Two measurements, in one process on bench_models.py's model (vocabulary 8192):

1. Throughput. Workload A's 32 prompts, 64 new tokens each, greedy, decoded free and
   under a constraint that cannot end within 64 tokens (so every contender generates the
   same number of tokens): a JSON schema of an open-ended list of strings, and a regex
   of at least 200 words. One LLM per backend (xgrammar, llguidance), built once; the
   contenders run in turn, who goes first rotating each round. Reported: medians of the
   wall time, the median of each run's time over the free run's in the same round, and
   the CPU time the grammars took (filling the bitmasks and accepting the tokens,
   measured as thread time, which other jobs on the machine do not inflate). Each
   constraint is compiled before the timed rounds: the steady state, every request
   finding its grammar in the cache.
2. Compile time. Each schema of SCHEMAS compiled cold by each backend (its Compiler, no
   cache), the median of a few compiles; and the wait a first request sees.

    python benchmarks/structured_outputs.py [--repeats 5] [--prompts 32] [--new-tokens 64] [--quick]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_models.py and roofline.py, beside this file

from bench_models import FULL, QUICK, build_model, make_workloads, num_kv_blocks_for  # noqa: E402
from roofline import describe_machine  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.entrypoints.api.tools.tool_calls import required_calls_schema  # noqa: E402
from tinyserve.models.tokenizer import load_tokenizer  # noqa: E402
from tinyserve.sampling_params import StructuredOutputsParams  # noqa: E402
from tinyserve.structured_output import STRUCTURED_OUTPUT_BACKENDS, get_backend_module  # noqa: E402

OPEN_ENDED = {  # nothing in it lets the output end early: 64 tokens of it, whatever the model picks
    "json": StructuredOutputsParams(json={"type": "object", "properties": {"lines": {"type": "array", "items": {
        "type": "string"}, "minItems": 1000}}, "required": ["lines"]}),
    "regex": StructuredOutputsParams(regex=r"([a-z]+ ){200,}"),
}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                         "address": {"$ref": "#/$defs/address"}},
          "$defs": {"address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                 "city": {"type": "string"}}}}}
TOOLS = [{"name": f"tool_{i}", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["query"]}}
    for i in range(8)]
SCHEMAS = {
    "json_object": StructuredOutputsParams(json_object=True),
    "small schema (2 fields)": StructuredOutputsParams(json={"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "n": {"type": "integer"}}, "required": ["answer", "n"]}),
    "nested schema ($defs, pattern)": StructuredOutputsParams(json=PERSON),
    "8 tools, tool_choice required": StructuredOutputsParams(json=required_calls_schema(TOOLS)),
    "regex (an ISO date)": StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}"),
    "choice (4 strings)": StructuredOutputsParams(choice=["red", "green", "blue", "yellow"]),
    "EBNF grammar (arithmetic)": StructuredOutputsParams(grammar='root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                                                                 'term ::= [0-9]+ | "(" expr ")"'),
}


class GrammarClock:
    """The CPU time (this thread's: load on the machine does not inflate it) an LLM's grammars take:
    filling each step's bitmask (StructuredOutputManager.grammar_bitmask) and accepting each token."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        manager = llm.engine_core.structured_output
        fill = manager.grammar_bitmask

        def timed_fill(scheduler_output, requests):
            start = time.thread_time()
            fill(scheduler_output, requests)
            self.seconds += time.thread_time() - start

        manager.grammar_bitmask = timed_fill
        grammar_class = get_backend_module(manager.backend_name).Grammar
        accept = grammar_class.accept

        def timed_accept(grammar, token_id: int) -> bool:
            start = time.thread_time()
            try:
                return accept(grammar, token_id)
            finally:
                self.seconds += time.thread_time() - start

        grammar_class.accept = timed_accept


def run(llm: LLM, clock: GrammarClock, workload, constraint) -> tuple[float, float, int]:
    """(seconds, grammar CPU seconds, tokens generated) of one generate()."""
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_lens[0], ignore_eos=True,
                            structured_outputs=constraint)
    clock.seconds = 0.0
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    return time.perf_counter() - start, clock.seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def throughput(folder: str, workload, num_kv_blocks: int, repeats: int) -> list[str]:
    engines = {}
    for backend in STRUCTURED_OUTPUT_BACKENDS:
        llm = LLM(folder, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=2048, enable_prefix_caching=False,
                  structured_outputs_backend=backend)
        engines[backend] = (llm, GrammarClock(llm))
    contenders = [("free", "xgrammar", None)] + [(f"{kind}, {backend}", backend, constraint)
                                                for backend in STRUCTURED_OUTPUT_BACKENDS
                                                for kind, constraint in OPEN_ENDED.items()]
    results = {name: [] for name, _, _ in contenders}
    for name, backend, constraint in contenders:  # warm-up: compiles each constraint once
        run(*engines[backend], workload, constraint)
    for repeat in range(repeats):
        order = contenders[repeat % len(contenders):] + contenders[:repeat % len(contenders)]
        for name, backend, constraint in order:
            results[name].append(run(*engines[backend], workload, constraint))
            print(f"round {repeat + 1}: {name}: {results[name][-1][0]:.2f} s", file=sys.stderr, flush=True)
    rows = []
    for name, runs in results.items():
        seconds = statistics.median(r[0] for r in runs)
        ratio = statistics.median(run[0] / free[0] for run, free in zip(runs, results["free"]))  # same round
        grammar = statistics.median(r[1] for r in runs)
        tokens = runs[0][2]
        rows.append(f"{name:<22} {seconds:>9.3f} {tokens / seconds:>13.1f} {ratio:>13.2f}x "
                    f"{grammar * 1e3:>15.1f} {grammar * 1e3 / tokens:>12.3f} {tokens:>7}")
    return rows


def compile_times(folder: str, vocab_size: int, repeats: int) -> list[str]:
    tokenizer = load_tokenizer(folder)
    compilers = {}
    for backend in STRUCTURED_OUTPUT_BACKENDS:
        start = time.perf_counter()
        compilers[backend] = get_backend_module(backend).Compiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
        compilers[backend].setup_ms = (time.perf_counter() - start) * 1e3
    rows = [f"{'vocabulary set-up (once)':<32}" + "".join(f"{c.setup_ms:>14.1f}" for c in compilers.values())]
    for name, params in SCHEMAS.items():
        cells = []
        for compiler in compilers.values():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                compiler.matcher(compiler.compile(params))
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3:>14.1f}")
        rows.append(f"{name:<32}" + "".join(cells))
    return rows


def first_request_wait(folder: str, num_kv_blocks: int) -> list[str]:
    """A new schema's first request against the same request once its grammar is cached (xgrammar)."""
    llm = LLM(folder, num_kv_blocks=num_kv_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            structured_outputs=SCHEMAS["nested schema ($defs, pattern)"])
    rows = []
    for label in ("first request (compiles)", "second request (cached)"):
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
        rows.append(f"{label:<32}{(time.perf_counter() - start) * 1e3:>10.1f} ms to its first token")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None, help="rounds (default 5; 1 with --quick)")
    parser.add_argument("--prompts", type=int, default=None, help="the first N of workload A's prompts (default all)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default 64)")
    parser.add_argument("--quick", action="store_true", help="bench_models.py's tiny model and workloads: a smoke test")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    shape = QUICK if args.quick else FULL
    print(f"machine: {describe_machine()}")
    with tempfile.TemporaryDirectory(prefix="tinyserve-structured-") as tmp:
        folder = os.path.join(tmp, "model")
        build_model(folder, shape, args.quick)
        workloads = make_workloads(shape, args.quick)
        workload = workloads[0]
        workload.prompts = workload.prompts[:args.prompts]
        workload.output_lens = [args.new_tokens or workload.output_lens[0]] * len(workload.prompts)
        num_kv_blocks = num_kv_blocks_for(workloads)
        rows = throughput(folder, workload, num_kv_blocks, repeats)
        compiled = compile_times(folder, shape.vocab_size, 3 if not args.quick else 1)
        waits = first_request_wait(folder, num_kv_blocks)

    print(f"\n{workload.describe()}; {repeats} rounds, medians\n")
    print(f"{'contender':<22} {'seconds':>9} {'output tok/s':>13} {'time vs free':>14} {'grammar CPU ms':>15} "
          f"{'ms / token':>12} {'tokens':>7}")
    print("\n".join(rows))
    print(f"\ncompile time per schema, ms (vocabulary {shape.vocab_size}; median of {3 if not args.quick else 1}; "
          "grammar and first matcher)\n")
    print(f"{'schema':<32}" + "".join(f"{backend:>14}" for backend in STRUCTURED_OUTPUT_BACKENDS))
    print("\n".join(compiled))
    print()
    print("\n".join(waits))
    print(f"\nat the end: load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
