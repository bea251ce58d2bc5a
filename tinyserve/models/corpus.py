"""Training text that ships with tinyserve: the Zen of Python and stdlib docstrings.

The built-in default model and the tests' tiny tokenizers are trained offline, so their
text has to be on the machine already. Python's standard library is such a source (its
docstrings are English prose about programming, and `this.py` holds the Zen of Python),
but it changes between releases: a tokenizer or model trained on the running
interpreter's files was another one on every Python version. So the text was copied
once, from one Python, into corpus.json beside this file, and everything reads it from
there; `scripts/build_default_model.py --extract-text` writes it again.
"""

import functools
import json
from collections.abc import Iterable
from pathlib import Path

CORPUS_FILE = Path(__file__).with_name("corpus.json")


@functools.cache
def _corpus() -> dict:
    return json.loads(CORPUS_FILE.read_text(encoding="utf-8"))


def corpus_python() -> str:
    """The version of the Python whose files the text was copied from, e.g. "3.11.7"."""
    return _corpus()["python"]


def zen_of_python() -> list[str]:
    """The Zen of Python, one aphorism per item (title line first)."""
    return list(_corpus()["zen"])


def stdlib_modules() -> list[str]:
    """The standard-library modules whose docstrings the corpus holds."""
    return list(_corpus()["docstrings"])


def stdlib_docstrings(module_names: Iterable[str]) -> list[str]:
    """Every docstring (module, classes, functions) of the named stdlib modules, module
    by module, each module's in the fixed breadth-first order of `ast.walk`."""
    docstrings = _corpus()["docstrings"]
    texts = []
    for module_name in module_names:
        if module_name not in docstrings:
            known = ", ".join(docstrings)
            raise ValueError(f"module_names: {module_name!r} is not in {CORPUS_FILE.name}, which holds {known}")
        texts.extend(docstrings[module_name])
    return texts
