"""--kv-events-config (LLM(kv_events_config=...)): vLLM's KVEventsConfig fields, each checked by name.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}

An endpoint with a `*` (or ipc://, inproc://) is bound, any other is connected to, as in vLLM.
Under data parallelism each engine publishes on the endpoint's port plus its rank.

The `*` binds `bind_host` (tinyserve's own field), not every interface: a server's --host (so 127.0.0.1
by default, as its HTTP), loopback offline. The events carry every prompt's token ids (BlockStored), so
a subscriber on the network would read other users' prompts; `--host 0.0.0.0` (or bind_host "0.0.0.0")
publishes on every interface, as vLLM's `tcp://*:5557` does.
"""

from dataclasses import asdict, dataclass

PUBLISHERS = ("null", "zmq")


@dataclass(slots=True, frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # vLLM's default; "zmq" publishes
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket that resends missed batches (vLLM's replay)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""
    bind_host: str | None = None  # the interface a `*` binds: the server's --host; None: loopback

    @classmethod
    def from_dict(cls, config: dict) -> "KVEventsConfig":
        if not isinstance(config, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {config!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}")
        made = cls(**config)
        if not isinstance(made.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {made.enable_kv_cache_events!r}")
        if made.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {list(PUBLISHERS)}, got {made.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(made, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer of at least 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(made, name)
            if value is not None and not (isinstance(value, str) and value.split("://")[0] in ("tcp", "ipc", "inproc")):
                raise ValueError(f"kv_events_config.{name} must be a ZeroMQ endpoint (tcp://, ipc:// or inproc://), "
                                 f"got {value!r}")
        if not isinstance(made.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {made.topic!r}")
        if made.bind_host is not None and not (isinstance(made.bind_host, str) and made.bind_host.strip()):
            raise ValueError(f"kv_events_config.bind_host must be a host name or address, got {made.bind_host!r}")
        return made

    @classmethod
    def from_any(cls, config) -> "KVEventsConfig":
        """From a dict, its JSON text (as on the command line), or a dataclass with these fields (vLLM's)."""
        if isinstance(config, str):
            import json

            config = json.loads(config)
        elif hasattr(config, "__dataclass_fields__"):
            config = {name: getattr(config, name) for name in config.__dataclass_fields__}
        return cls.from_dict(config)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    def to_dict(self) -> dict:
        return asdict(self)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: rank R publishes on the endpoint's port + R (tcp), or endpoint + `_dpR` (inproc, ipc)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


LOOPBACK = "127.0.0.1"
EVERY_INTERFACE = ("*", "0.0.0.0", "::", "")


def bound_endpoint(endpoint: str | None, bind_host: str | None) -> str | None:
    """A `tcp://*:PORT` endpoint with its `*` made bind_host (None: loopback); any other endpoint as it is."""
    if not endpoint or not endpoint.startswith("tcp://*:"):
        return endpoint
    host = LOOPBACK if bind_host is None else bind_host.strip()
    if host in EVERY_INTERFACE:
        return endpoint
    port = endpoint.rpartition(":")[2]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def with_server_host(config: dict | None, host: str | None) -> dict | None:
    """A server's kv_events_config: bind_host its --host (HTTP's interface), unless the config names one."""
    if config is None or host is None or config.get("bind_host") is not None:
        return config
    return {**config, "bind_host": host}


def parse_kv_events_config(text: str) -> dict:
    """The flag's JSON, checked; returned as the dict EngineArgs keeps."""
    import json

    return KVEventsConfig.from_dict(json.loads(text)).to_dict()
