"""The training text that ships with tinyserve (tinyserve/models/corpus.json).

It is the Zen of Python and stdlib docstrings as one Python release had them, read the
same under every Python; scripts/build_default_model.py --extract-text wrote it, and on
that same release writes it again unchanged.
"""

import importlib.util
import platform

import pytest

from tests.pythons import ROOT
from tinyserve.models import corpus


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_default_model", ROOT / "scripts" / "build_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_text_holds_the_zen_and_the_docstrings_of_every_module_the_tokenizer_needs():
    build_script = load_build_script()
    assert corpus.zen_of_python()[1] == "Beautiful is better than ugly."
    assert corpus.stdlib_modules() == list(build_script.TOKENIZER_MODULES)
    assert all(corpus.stdlib_docstrings([name]) for name in corpus.stdlib_modules())


@pytest.mark.skipif(platform.python_version() != corpus.corpus_python(), reason="the text came from another Python")
def test_extracting_the_text_again_on_its_python_gives_the_shipped_text():
    extracted = load_build_script().extract_text()
    assert extracted["zen"] == corpus.zen_of_python()
    assert extracted["docstrings"] == {name: corpus.stdlib_docstrings([name]) for name in corpus.stdlib_modules()}


def test_a_module_not_in_the_text_is_refused_by_name():
    with pytest.raises(ValueError, match="module_names: 'asyncio' is not in corpus.json"):
        corpus.stdlib_docstrings(["textwrap", "asyncio"])
