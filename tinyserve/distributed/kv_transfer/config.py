"""--kv-transfer-config: vLLM's KVTransferConfig, the fields a tinyserve KV connector reads.

    {"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
     "kv_ip": "127.0.0.1", "kv_port": 0, "engine_id": "...",
     "kv_connector_extra_config": {"abort_request_timeout": 480, "transfer_timeout": 30}}

kv_connector omitted: this machine's default (`default_connector`). kv_role: kv_producer (prefills for
others), kv_consumer (decodes what others prefilled) or kv_both. kv_ip/kv_port: where this engine's
side channel listens and what it tells decode engines (port 0: one the system picks). The extra
config's abort_request_timeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT (seconds a producer keeps
blocks nobody pulls), transfer_timeout the seconds a consumer waits for a pull to complete. Any
other field is refused, named: none is silently ignored.

The secret that makes engines peers is not a field (a flag's value shows in `ps`): it is read from
$TINYSERVE_KV_TRANSFER_SECRET, the same on every prefill and decode engine (trust.py).
"""

import uuid
from dataclasses import dataclass, field

from tinyserve.distributed.kv_transfer.trust import shared_secret

from tinyserve import extras

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("MooncakeConnector", "ZmqConnector")
EXTRA_CONFIG = {"abort_request_timeout": 480.0, "transfer_timeout": 30.0}
FIELDS = ("kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_connector_extra_config")


def mooncake_unusable() -> str | None:
    """Why Mooncake's transfer engine cannot run here (not installed: the pd extra; or it does not load,
    as without libibverbs, which it needs even over TCP); None where it can."""
    if not extras.installed("pd"):
        return extras.missing_message("kv_connector MooncakeConnector", "pd")
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as error:  # its shared libraries missing
        return (f"kv_connector MooncakeConnector: Mooncake's transfer engine does not load here ({error}); "
                "it needs the system's libibverbs (Debian: apt-get install libibverbs1)")
    return None


def default_connector() -> str:
    """MooncakeConnector where Mooncake's transfer engine loads, else ZmqConnector, which needs nothing
    beyond the project's own dependencies."""
    return "ZmqConnector" if mooncake_unusable() else "MooncakeConnector"


@dataclass(slots=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    abort_request_timeout: float = EXTRA_CONFIG["abort_request_timeout"]
    transfer_timeout: float = EXTRA_CONFIG["transfer_timeout"]
    shared_secret: str | None = field(default=None, repr=False)  # $TINYSERVE_KV_TRANSFER_SECRET (trust.py)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, config: dict) -> "KVTransferConfig":
        """Checked field by field; a ValueError names the one at fault."""
        if not isinstance(config, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {config!r}")
        unknown = sorted(set(config) - set(FIELDS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown or unsupported field(s) {unknown}; known: {list(FIELDS)}")
        connector = config.get("kv_connector") or default_connector()
        if connector not in CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {list(CONNECTORS)}, got {connector!r}")
        if connector == "MooncakeConnector" and (why := mooncake_unusable()):
            raise ValueError(f"kv_transfer_config.{why} (kv_connector ZmqConnector needs nothing more)")
        if config.get("kv_role") not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {list(KV_ROLES)}, got {config.get('kv_role')!r}")
        port = config.get("kv_port", 0)
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a port number (0: any free one), got {port!r}")
        extra = config.get("kv_connector_extra_config") or {}
        unknown = sorted(set(extra) - set(EXTRA_CONFIG))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown field(s) {unknown}; "
                             f"known: {list(EXTRA_CONFIG)}")
        for name, value in extra.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name} must be a positive number "
                                 f"of seconds, got {value!r}")
        return cls(connector, config["kv_role"], str(config.get("engine_id") or uuid.uuid4()),
                   str(config.get("kv_ip", "127.0.0.1")), port, **{k: float(v) for k, v in extra.items()},
                   shared_secret=shared_secret())


def check_engine_args(args) -> None:
    """EngineArgs.validate: the config's fields, and what a KV connector cannot be combined with."""
    KVTransferConfig.from_dict(args.kv_transfer_config)
    for refused, what in ((args.runner == "pooling" or args.convert == "embed", "a pooling runner"),
                          (args.tensor_parallel_size > 1 or args.force_tensor_parallel, "tensor parallelism"),
                          (getattr(args, "pipeline_parallel_size", 1) > 1, "pipeline parallelism"),
                          (args.speculative_config is not None, "speculative_config")):
        if refused:
            raise ValueError(f"kv_transfer_config is not supported with {what}")
