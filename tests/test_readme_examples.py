"""Every example of the README, run as a reader would: the Python ones as scripts, the shell ones under bash.

Each runs in a fresh interpreter, unguarded (no `if __name__ == "__main__":`), from an empty
folder: the engine processes it starts must not import the script again
(tinyserve/engine/child_process.py). An example without a check below fails the test, so
a new one gets its own.

A shell block that is a capability script (it begins `PORT=${PORT:-8000}`) starts its servers on
the built-in model, waits for /health, asks, and stops them; here it runs under bash from the
checkout, PORT a free port with the two after it free too, this environment's bin/ first on the
PATH, and what it prints is checked. Each starts its own servers, since each serves with other
flags: 25 to 90 s apiece on two busy cores. A block that is not such a script must be named in
NOT_RUN with what it needs that a test cannot have.
"""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_turns import ray_cluster_turn

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def check_offline(lines: list[str]) -> None:
    text, cached = lines[0].rsplit(" ", 1)  # print(text, num_cached_tokens)
    assert text.strip() and int(cached) >= 0
    assert len(lines) == 2 and lines[1].strip()  # the chat's reply


def check_streaming(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert len(text.split()) >= 5  # a sentence streamed, not only its full stop (the prompt's first piece)
    assert text.count(".") <= 1  # aborted at the first full stop (seeded: the same text every run)


def check_structured(lines: list[str]) -> None:
    assert json.loads(lines[-1]) in ({"answer": "yes"}, {"answer": "no"})


def check_embeddings(lines: list[str]) -> None:
    assert lines[-1] == "256"  # the built-in model's hidden size


CHECKS = {"AsyncLLM": check_streaming, "StructuredOutputsParams": check_structured, "llm.chat": check_offline,
          "llm.embed": check_embeddings}


def check_for(example: str):
    [check] = [check for marker, check in CHECKS.items() if marker in example]
    return check


def test_the_readme_has_the_examples_these_checks_know():
    assert len(EXAMPLES) == len(CHECKS)
    assert sorted(check_for(example).__name__ for example in EXAMPLES) == sorted(c.__name__ for c in CHECKS.values())


@pytest.mark.parametrize("example", EXAMPLES, ids=[check_for(e).__name__.removeprefix("check_") for e in EXAMPLES])
def test_the_example_runs_as_a_plain_script(example, tmp_path):
    (tmp_path / "example.py").write_text(example, encoding="utf-8")
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    check_for(example)(done.stdout.splitlines())


# The shell blocks.

ROOT = README.parent
BLOCKS = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
PORT_LINE = "PORT=${PORT:-8000}\n"
SCRIPTS = [block for block in BLOCKS if block.startswith(PORT_LINE)]

# The other blocks, by how each begins: why a test does not run it, and what runs it instead.
NOT_RUN = {
    "make serve": "the set-up and this suite itself (tests/test_serve_install.py installs the serve set)",
    ".venv/bin/tinyserve chat": "an interactive client of `make serve`'s server (tests/test_cli.py runs tinyserve chat)",
    ".venv/bin/tinyserve serve /models/": "real models this machine need not have (tests/test_llm_parity.py: tiny ones of each family)",
    "guidellm run": "guidellm, a benchmark client of its own that the test set does not install",
    "# head, at 10.0.0.1": "two machines (tests/test_multi_node.py: a node in a network namespace)",
    "ray start --head": "a Ray cluster of several machines (tests/test_ray_backends.py, on one)",
    "bash scripts/offline_wheels.sh": "the offline install (tests/test_offline_install.py rehearses it)",
    "pip install --no-index": "the offline install (tests/test_offline_install.py rehearses it)",
}


def completions(lines: list[str]) -> list[dict]:
    """The JSON answers among the lines, each with its choices checked non-empty."""
    answers = [json.loads(line) for line in lines if line.startswith("{")]
    for answer in answers:
        if "choices" in answer:
            assert answer["choices"] and answer["usage"]["completion_tokens"] > 0, answer
    return answers


def check_speculative(lines):
    [answer] = completions(lines)
    counts = {line.split("{")[0]: line.rsplit(" ", 1)[1] for line in lines if line.startswith("tinyserve:spec_decode")}
    drafted, accepted = (float(counts[f"tinyserve:spec_decode_num_{name}_tokens_total"]) for name in ("draft", "accepted"))
    assert drafted > 0 and 0 <= accepted <= drafted


def check_disaggregated(lines):
    [answer] = completions(lines)
    assert answer["choices"][0]["message"]["content"]


def check_api_servers(lines):
    assert len([answer for answer in completions(lines) if "choices" in answer]) == 4


def check_one_completion(lines):
    [answer] = completions(lines)
    assert answer["choices"][0]["text"]


def check_lora(lines):
    models, answer = completions(lines)
    assert {"sql", "chat", "tinyserve-default"} <= {model["id"] for model in models["data"]}
    assert answer["model"] == "sql"


def check_embeddings_script(lines):
    assert lines[-1] == "[256, 256]"


def check_images(lines):
    tokens, answer = lines[-1].split(" prompt tokens: ")
    assert int(tokens) == 277 and answer  # 256 of them the picture's placeholders


def check_kv_events(lines):
    assert any(line.startswith("BlockStored [") for line in lines), lines


SCRIPT_CHECKS = {"--speculative-config": check_speculative, "--kv-transfer-config": check_disaggregated,
          "--api-server-count": check_api_servers, "--pipeline-parallel-size": check_one_completion,
          "--data-parallel-backend ray": check_one_completion, "--enable-lora": check_lora,
          "--runner pooling": check_embeddings_script, "--kv-events-config": check_kv_events,
          "tinyserve-vision": check_images}


def script_check_for(script: str):
    [check] = [(marker, check) for marker, check in SCRIPT_CHECKS.items() if marker in script]
    return check


def test_every_shell_block_is_a_script_run_here_or_says_why_not():
    others = [block for block in BLOCKS if not block.startswith(PORT_LINE)]
    reasons = [[start for start in NOT_RUN if block.startswith(start)] for block in others]
    assert all(len(found) == 1 for found in reasons), [block.splitlines()[0] for block in others]
    assert sorted(start for [start] in reasons) == sorted(NOT_RUN)  # none listed that is gone
    assert sorted(marker for marker, _ in map(script_check_for, SCRIPTS)) == sorted(SCRIPT_CHECKS)


def free_ports(count: int) -> int:
    """A port with the count - 1 after it free too (bound for a moment, each)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + count > 65535:
            continue
        try:
            for other in range(port, port + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", other))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {count} free ports in a row")


@pytest.mark.parametrize("script", SCRIPTS, ids=[script_check_for(s)[0].strip("-").split()[-1] for s in SCRIPTS])
def test_the_script_runs_as_written(script, tmp_path):
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PORT": str(free_ports(3)), "PATH": os.pathsep.join([bin_dir, os.environ["PATH"]]),
           "HF_HUB_OFFLINE": "1"}
    # A script that starts Ray waits for any other test's Ray cluster to end (tests/ray_turns.py).
    with ray_cluster_turn() if "ray" in script_check_for(script)[0] else contextlib.nullcontext():
        process = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=540)
        finally:
            try:  # whatever the script left running (it failed before its kill): its whole session
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert process.returncode == 0, stderr[-4000:]
    try:  # a server that never came up still lets the script end 0: its output says why
        script_check_for(script)[1]([line for line in stdout.splitlines() if line.strip()])
    except (AssertionError, ValueError) as failure:
        raise AssertionError(f"{failure!r}\nstdout: {stdout[-2000:]}\nstderr: {stderr[-4000:]}") from failure
