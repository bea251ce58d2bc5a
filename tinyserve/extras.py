"""pyproject.toml's optional extras: a capability asked for without its extra says which one to install.

`make serve` (scripts/setup.sh's serve set) installs none of them; `make test` installs all.

    ray      --distributed-executor-backend ray, --data-parallel-backend ray (tinyserve/distributed/)
    pd       kv_connector MooncakeConnector: disaggregated prefill over Mooncake's transfer engine
             (the default connector where it loads; ZmqConnector needs nothing more)
    triton   --attention-backend triton on a CPU, through Triton's interpreter (torch's CUDA build
             brings the triton it was built with)
"""

import importlib.util

# extra -> (the module it installs, what a message calls it)
EXTRAS = {"ray": ("ray", "Ray"), "pd": ("mooncake", "Mooncake's transfer engine"), "triton": ("triton", "Triton")}


def installed(extra: str) -> bool:
    """Whether the extra's module is importable here (found, not imported: Ray takes seconds to import)."""
    return importlib.util.find_spec(EXTRAS[extra][0]) is not None


def missing_message(asked: str, extra: str) -> str:
    """`asked` (the flag and value that needs the extra) needs ..., with the command that installs it."""
    return f"{asked} needs {EXTRAS[extra][1]}, which is not installed: the {extra} extra, pip install 'tinyserve[{extra}]'"


def require(asked: str, extra: str) -> None:
    """ValueError naming the extra and how to install it, when it is not installed."""
    if not installed(extra):
        raise ValueError(missing_message(asked, extra))
