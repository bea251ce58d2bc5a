"""Every Python example of the README, saved as a file and run as a script, as a reader would.

Each runs in a fresh interpreter, unguarded (no `if __name__ == "__main__":`), from an empty
folder: the engine processes it starts must not import the script again
(tinyserve/engine/child_process.py). An example without a check below fails the test, so
a new one gets its own.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def check_offline(lines: list[str]) -> None:
    text, cached = lines[0].rsplit(" ", 1)  # print(text, num_cached_tokens)
    assert text.strip() and int(cached) >= 0
    assert len(lines) == 2 and lines[1].strip()  # the chat's reply


def check_streaming(lines: list[str]) -> None:
    text = "\n".join(lines)
    assert text.strip()
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
