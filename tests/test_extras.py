"""A capability asked for without its extra names the extra and the command that installs it.

`make serve` installs none of pyproject.toml's extras (scripts/setup.sh's serve set), so a newcomer
who asks for Triton's kernels, Mooncake's connector or Ray (tests/test_ray_backends.py) first meets
these messages. The extras are installed here (`make test`): their absence is what is played.
"""

import json
import tomllib

import pytest

from tests.pythons import ROOT
from tinyserve import extras
from tinyserve.cli.main import main


@pytest.fixture
def without(monkeypatch):
    def uninstall(*names: str) -> None:
        installed = extras.installed
        monkeypatch.setattr(extras, "installed", lambda extra: extra not in names and installed(extra))

    return uninstall


def test_the_triton_backend_without_triton_names_the_triton_extra(without):
    from tinyserve.assemble import check_engine_args
    from tinyserve.config import EngineArgs

    without("triton")
    with pytest.raises(ValueError, match=r"^attention_backend='triton' \(on a CPU, through Triton's interpreter\) "
                                         r"needs Triton, which is not installed: the triton extra, "
                                         r"pip install 'tinyserve\[triton\]'$"):
        check_engine_args(EngineArgs(attention_backend="triton"))


def test_mooncakes_connector_without_mooncake_names_the_pd_extra_and_the_default_is_zeromq(without, capsys):
    from tinyserve.distributed.kv_transfer.config import KVTransferConfig

    without("pd")
    config = {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}
    with pytest.raises(SystemExit) as exited:  # a usage error, as argparse gives it
        main(["serve", "--kv-transfer-config", json.dumps(config)])
    assert exited.value.code == 2
    assert ("kv_transfer_config.kv_connector MooncakeConnector needs Mooncake's transfer engine, which is not "
            "installed: the pd extra, pip install 'tinyserve[pd]' (kv_connector ZmqConnector needs nothing more)"
            in capsys.readouterr().err)
    assert KVTransferConfig.from_dict({"kv_role": "kv_both"}).kv_connector == "ZmqConnector"


def test_every_extra_named_in_a_message_is_one_of_pyprojects_and_installs_that_module():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    distributions = {"ray": "ray", "pd": "mooncake-transfer-engine-non-cuda", "triton": "triton"}
    for extra in extras.EXTRAS:
        assert [line for line in optional[extra] if line.startswith(distributions[extra])], extra
        assert extras.installed(extra), extra  # `make test` installs every extra
