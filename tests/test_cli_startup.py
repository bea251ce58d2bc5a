"""A command line that answers at once: `tinyserve --help`, and every (sub)command's, in well under a second.

The spec is what the parser imports: building it, every subcommand's flags included, must load
none of the heavy libraries (torch, transformers, FastAPI, uvicorn, numpy, OpenTelemetry,
httpx, ...). They are imported after the arguments are parsed, by the command that needs them.
The first test checks exactly that, in a fresh interpreter (this process has imported them all).

The second times what a user sees: `python -m tinyserve.cli.main ... --help`, each command in a
process of its own, by the processor time the process used (user + system, from the kernel's
accounting of the child), against `python -c pass` measured the same way in the same test. The
bound is max(0.5 s, 4 x that baseline): 0.5 s is the goal, met with room on an idle 2-core
machine (about 0.1 s of interpreter start and 0.15-0.3 s of our imports and argparse).
Processor time, not wall time, because on a machine busy with other work a process waits for a
core for as long as the others run, and an import-heavy start waits far more often than
`python -c pass` does; the time it computes barely moves. A help that imported torch again
takes 4-6 s of it and fails either way. Each help is the best of three runs. About a hundred
processes: marked slow.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests.pythons import ROOT

# Each of these takes from a quarter of a second (httpx, starlette) to seconds (torch) to import.
HEAVY = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "fastapi", "starlette", "uvicorn",
         "pydantic", "opentelemetry", "httpx", "prometheus_client", "zmq", "matplotlib", "numba", "tqdm",
         "xgrammar", "llguidance", "ray", "jinja2")

GOAL_S = 0.5


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def _commands() -> list[list[str]]:
    """Every command path of the parser: [], ["serve"], ..., ["trace", "summarize"], ..."""
    from tinyserve.cli.main import build_parser

    def walk(parser: argparse.ArgumentParser, path: list[str]):
        yield path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])

    return list(walk(build_parser(), []))


def test_building_the_parser_imports_no_heavy_library():
    probe = ("import json, sys\n"
             "from tinyserve.cli.main import build_parser\n"
             "build_parser()\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def _cpu_seconds(command: list[str]) -> float:
    """The user + system time the command's process used, as the kernel counted it."""
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=_env(), cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        assert process.returncode == 0, stderr.read().decode(errors="replace")
    return usage.ru_utime + usage.ru_stime


def _best_of(runs: int, command: list[str]) -> float:
    return min(_cpu_seconds(command) for _ in range(runs))


@pytest.mark.slow
def test_every_help_answers_within_half_a_second_or_four_interpreter_starts():
    commands = _commands()
    assert ["serve"] in commands and ["trace", "summarize"] in commands and ["bench", "serve"] in commands
    slow = {}
    for path in commands:
        baseline = _best_of(2, [sys.executable, "-c", "pass"])  # beside each command
        took = _best_of(3, [sys.executable, "-m", "tinyserve.cli.main", *path, "--help"])
        if took > max(GOAL_S, 4 * baseline):
            slow[" ".join(["tinyserve", *path, "--help"])] = f"{took:.2f} s of processor time (python -c pass: {baseline:.2f} s)"
    assert not slow, slow
