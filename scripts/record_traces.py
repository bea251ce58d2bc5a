"""Record the traced runs the walkthrough notebooks load (traces/recorded-*), from real servers.

    .venv/bin/python scripts/record_traces.py                     every run, into traces/
    .venv/bin/python scripts/record_traces.py lifecycle kv-tight  only these
    .venv/bin/python scripts/record_traces.py --out /tmp/runs lifecycle

Each recording starts `tinyserve serve --trace --trace-dir <tmp>` on the built-in model as
a subprocess, waits for /health, sends one tiny warm-up request, drives a workload over
HTTP (the `openai` client for the single chat, httpx for the rest), stops the server with
SIGTERM (it drains and flushes every span on the way out) and moves the run folder to
<out>/recorded-<name>/. The warm-up request's trace, and the steps that served only it,
are then removed from the files; everything else is exactly what the server wrote. A
recording.json next to them says how the run was made: the server command, the
workload, and a fingerprint of the model that served it. Sampling is greedy or seeded
everywhere, so every request can be replayed; prompts and arrival times come from fixed
seeds.

The notebooks call `record(name, out_dir)` themselves when RECORD_FRESH is set.
"""

import argparse
import asyncio
import concurrent.futures
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout that is not pip-installed
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, recording_servers.py

from recording_pictures import PICTURES, data_url  # noqa: E402
from recording_servers import HEAD_HOST, NODE_HOST, SERVER_ENV, deployment, run_folder  # noqa: E402

from tinyserve.trace_reading.replay import ADAPTERS_FOLDER  # noqa: E402  where replay reads a run's adapters

MODEL = "tinyserve-default"
RECORDING_FILE = "recording.json"

# PEP 20, the prompts' raw material: the built-in model was trained on it, so its
# outputs stay on topic, and the text is the same on every Python.
ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
    "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
    "Readability counts.", "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.", "Unless explicitly silenced.",
    "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.", "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]  # fmt: skip


@dataclass
class Request:
    """One HTTP request of a workload: sent `at_s` seconds after the workload starts."""

    at_s: float
    path: str  # /v1/completions or /v1/chat/completions
    body: dict
    headers: dict | None = None
    disconnect_after: int | None = None  # a streaming client that leaves after this many lines of the stream
    backend: int | None = None  # sent to this rank's server directly, past the router in front (routed_ranks)


@dataclass
class Recording:
    name: str
    description: str
    flags: list[str]
    workload: list[Request] = field(default_factory=list)
    single_chat: dict | None = None  # sent with the openai client instead of a workload
    headless_flags: list[str] | None = None  # flags of a headless node serving some of the head's ranks
    routed_ranks: int = 0  # > 0: that many --data-parallel-rank servers with these flags, nginx in front
    kill_node_at_s: float | None = None  # the headless node is killed (SIGKILL) this long into the workload
    # LoRA adapters for the built-in model, made when recording (make_adapter) and served with --lora-modules
    adapters: tuple[str, ...] = ()
    router: list[str] | None = None  # with routed_ranks: `tinyserve router` with these flags in front, not nginx
    disaggregated: bool = False  # a prefill server and a decode server behind `tinyserve router --prefill --decode`
    warm_up_chars: int = 0  # > 0: the warm-up requests' prompts are this long, so long prefills run warm too
    model: str = MODEL  # the model served (a built-in one's name), named first in flags when it is not MODEL


def zen_text(rng: random.Random, num_chars: int) -> str:
    """Zen lines in a seeded random order until the text is about `num_chars` long (~4 chars a token)."""
    lines = []
    while sum(len(line) + 1 for line in lines) < num_chars:
        lines.append(rng.choice(ZEN))
    return " ".join(lines)


def completion(at_s: float, prompt: str, max_tokens: int, **extra) -> Request:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}
    return Request(at_s, "/v1/completions", body)


def lifecycle() -> Recording:
    chat = {
        "messages": [{"role": "system", "content": "You answer with one line of the Zen of Python."},
                     {"role": "user", "content": "Which is better, flat or nested?"}],
        "max_tokens": 24, "temperature": 0.8, "seed": 1234, "stream": True,
    }
    return Recording("lifecycle", "one streamed chat request (temperature 0.8, seed 1234), end to end", [],
                     single_chat=chat)


def mixed() -> Recording:
    """Prompts of ~10 to ~330 tokens and outputs of 8 to 96, arriving over ~0.5 s, with a small token budget."""
    rng = random.Random(2)
    workload, at = [], 0.0
    for num_chars in (60, 1200, 200, 40, 600, 120, 900, 80, 300, 1000, 50, 400, 150, 700, 90, 250):
        workload.append(completion(at, zen_text(rng, num_chars), rng.choice((8, 16, 32, 64, 96))))
        at += rng.expovariate(50.0)
    return Recording("mixed", "16 completions arriving over time (Poisson, 50/s), mixed prompt and output lengths, "
                     "chunked prefill with a 64-token step budget and 6 seats",
                     ["--max-num-batched-tokens", "64", "--max-num-seqs", "6"], workload)


def kv_workload() -> list[Request]:
    """12 chats sharing a ~250-token system prompt, 4 every 30 ms, each asked for 48 tokens."""
    rng = random.Random(3)
    system = "You are a Python style reviewer. Judge every answer by these rules: " + " ".join(ZEN)
    workload = []
    for i in range(12):
        body = {"model": MODEL, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": f"Review this: {zen_text(rng, 80)}"}]}
        workload.append(Request(0.03 * (i // 4), "/v1/chat/completions", body))
    return workload


def kv_tight() -> Recording:
    return Recording("kv-tight", "12 chats with a shared system prompt on a 40-block KV pool: prefix-cache hits "
                     "and preemptions", ["--num-kv-blocks", "40", "--max-num-batched-tokens", "256"], kv_workload())


def kv_roomy() -> Recording:
    return Recording("kv-roomy", "the kv-tight workload on a 1024-block pool: the same requests, no preemption",
                     ["--num-kv-blocks", "1024", "--max-num-batched-tokens", "256"], kv_workload())


def kv_no_prefix_cache() -> Recording:
    return Recording("kv-no-prefix-cache", "the kv-roomy run with the prefix cache off: every prompt computed whole",
                     ["--num-kv-blocks", "1024", "--max-num-batched-tokens", "256", "--no-enable-prefix-caching"],
                     kv_workload())


LOAD_FLAGS = ["--max-num-seqs", "4"]  # 4 seats: an engine on a CPU saturates at tens of requests per second


def load_workload(rate: float, num_requests: int = 24) -> list[Request]:
    """Poisson arrivals at `rate` requests/s; prompts of ~15-150 tokens, 8-24 output tokens, half of them streamed."""
    rng = random.Random(4)  # the same prompts at every rate: only the arrival times scale
    workload, at = [], 0.0
    for i in range(num_requests):
        extra = {"stream": True} if i % 2 else {}
        if i % 3 == 0:  # seeded sampling, still replayable
            extra.update(temperature=0.8, seed=i)
        workload.append(completion(at, zen_text(rng, rng.randint(60, 600)), rng.randint(8, 24), **extra))
        at += rng.expovariate(1.0) / rate
    return workload


def load(rate: int) -> Recording:
    return Recording(f"load-{rate}rps", f"24 completions, Poisson arrivals at {rate} requests/s, 4 seats",
                     LOAD_FLAGS, load_workload(rate))


def load_dp() -> Recording:
    return Recording("load-dp2", "the load-75rps workload on two engine processes (--data-parallel-size 2), "
                     "4 seats each", [*LOAD_FLAGS, "--data-parallel-size", "2"], load_workload(75))


def load_api2() -> Recording:
    return Recording("api2", "the load-75rps workload on two API processes (--api-server-count 2) in front of two "
                     "engine processes (--data-parallel-size 2), 4 seats each",
                     [*LOAD_FLAGS, "--data-parallel-size", "2", "--api-server-count", "2"], load_workload(75))


def load_tp() -> Recording:
    return Recording("load-tp2", "the load-25rps workload on one engine split over two tensor-parallel ranks "
                     "(--tensor-parallel-size 2), 4 seats", [*LOAD_FLAGS, "--tensor-parallel-size", "2"],
                     load_workload(25))


def pipeline() -> Recording:
    return Recording("pp2", "the load-25rps workload on one engine whose 4 layers are split into two pipeline stages "
                     "(--pipeline-parallel-size 2), two batches in flight, 4 seats", [*LOAD_FLAGS,
                     "--pipeline-parallel-size", "2"], load_workload(25))


MULTI_NODE = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]  # on the default address and port


def multi_node() -> Recording:
    return Recording("multi-node", "the load-75rps workload on a head (the API and engine 0) and a headless node "
                     "(engine 1), two processes on one machine talking over TCP; their spans' host.name says "
                     "head or node-1 (OTEL_RESOURCE_ATTRIBUTES)", [*LOAD_FLAGS, *MULTI_NODE],
                     load_workload(75), headless_flags=[*LOAD_FLAGS, *MULTI_NODE, "--data-parallel-start-rank", "1"])


def node_lost() -> Recording:
    return Recording("node-lost", "the multi-node deployment with --keep-alive-on-engine-death; the headless node is "
                     "killed (SIGKILL) 0.15 s into the load-75rps workload: the requests it held fail, the others "
                     "and those after it are served by the head's engine", [*LOAD_FLAGS, *MULTI_NODE,
                     "--keep-alive-on-engine-death"], load_workload(75),
                     headless_flags=[*LOAD_FLAGS, *MULTI_NODE, "--data-parallel-start-rank", "1"], kill_node_at_s=0.15)


def external_lb() -> Recording:
    return Recording("external-lb", "the load-75rps workload on two --data-parallel-rank servers (4 seats each) with "
                     "nginx in front (least_conn); the two run folders merged", LOAD_FLAGS, load_workload(75),
                     routed_ranks=2)


# Two ranks publishing KV cache events (rank R on port 5557 + R, vLLM's rule), for the router in front.
ROUTER_RANK_FLAGS = ["--max-num-seqs", "4", "--kv-events-config",
                     '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}']
ROUTER_POLICIES = {"prefix-aware": ["--policy", "prefix-aware", "--kv-events", "tcp://127.0.0.1:5557",
                                    "tcp://127.0.0.1:5558"],
                   "round-robin": ["--policy", "round_robin"]}


SECOND_WAVE_S = 6.0  # well after the first wave's prefills, on a busy two-core machine too


def shared_prefix_workload() -> list[Request]:
    """4 system prompts of ~1,200 characters, each with 5 questions: 20 chats in two waves.

    The first wave, two chats of each prompt back to back (20 ms apart), is routed before any backend has
    computed a prompt: the second chat of each can follow only its prompt's pending blocks. The second wave,
    the other three of each, shuffled, one every 50 ms, starts SECOND_WAVE_S later, when the first wave's
    blocks are stored and published: there the router matches the backends' BlockStored events."""
    rng = random.Random(5)
    systems = [f"Reviewer {p}. Judge every answer by these rules: {zen_text(rng, 1200)}" for p in range(4)]
    first = [(p, q) for p in range(4) for q in range(2)]
    second = [(p, q) for p in range(4) for q in range(2, 5)]
    rng.shuffle(second)
    times = [0.02 * i for i in range(len(first))] + [SECOND_WAVE_S + 0.05 * i for i in range(len(second))]
    return [Request(at, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "messages": [{"role": "system", "content": systems[p]}, {"role": "user", "content": f"Question {q}: "
                                                                 f"{zen_text(rng, 60)}"}]})
            for at, (p, q) in zip(times, first + second)]


def routed_by(policy: str) -> Recording:
    return Recording(f"router-{policy}", f"20 chats sharing 4 system prompts (5 each) in two waves "
                     f"{SECOND_WAVE_S:.0f} s apart, on two --data-parallel-rank servers behind "
                     f"`tinyserve router --policy {ROUTER_POLICIES[policy][1]}`; "
                     "the router's and both ranks' run folders merged", ROUTER_RANK_FLAGS, shared_prefix_workload(),
                     routed_ranks=2, router=ROUTER_POLICIES[policy])


LEAST_LOAD_FLAGS = ["--max-num-seqs", "1"]  # one seat each: a request waits whenever another runs there
LEAST_LOAD_WAVE_S = 1.5  # after both probes have answered, on a busy two-core machine too


def least_load_workload() -> list[Request]:
    """Two backends made to report different loads, then requests the router places by those reports.

    Two probes through the router at once (one to each backend: the second finds the first in flight); then
    4 completions sent straight to rank 0's server, past the router, which queue there behind its probe. Each
    probe's answer brings its backend's ORCA report: rank 0's counts the 4 waiting, rank 1's none. At
    LEAST_LOAD_WAVE_S, 6 completions through the router, 20 ms apart, placed by those reports and the
    router's own requests in flight. Every answer is whole (not streamed): only those carry the report."""
    rng = random.Random(19)
    probes = [completion(0.01 * i, zen_text(rng, 60), 16) for i in range(2)]
    direct = [replace(completion(0.1 + 0.01 * i, zen_text(rng, 60), 12), backend=0) for i in range(4)]
    wave = [completion(LEAST_LOAD_WAVE_S + 0.02 * i, zen_text(rng, 60), 8) for i in range(6)]
    return probes + direct + wave


def least_load() -> Recording:
    return Recording("router-least-load", "two --data-parallel-rank servers of one seat each behind `tinyserve "
                     "router --policy least_load`: a probe to each, 4 completions sent straight to rank 0 (past the "
                     "router), then 6 through the router, placed by the two backends' ORCA load reports; the "
                     "router's and both ranks' run folders merged", LEAST_LOAD_FLAGS, least_load_workload(),
                     routed_ranks=2, router=["--policy", "least_load"])


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


def cases() -> Recording:
    """Four requests one after the other, each a case the other runs do not show, far enough apart (on a
    quiet machine) that each runs alone: the disconnected one's release is then on a step of its own."""
    workload = [
        # n = 2: two engine requests, 0_<id> and 1_<id>, seeded 7 and 8, folded back into one answer
        Request(0.0, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "Say two things about namespaces."}],
            "n": 2, "temperature": 0.8, "seed": 7, "max_tokens": 12}),
        # a client that leaves mid-stream, with nothing else running: the engine aborts it and goes idle
        Request(1.0, "/v1/completions", {"model": MODEL, "prompt": zen_text(random.Random(5), 200),
                                          "max_tokens": 200, "temperature": 0.0, "ignore_eos": True, "stream": True},
                disconnect_after=8),
        # structured output: a grammar compiled beside the scheduler, a bitmask in every step it samples
        Request(2.5, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "The weather in Paris, as JSON."}],
            "temperature": 0.0, "max_tokens": 48,
            "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}}),
        # the ORCA load report a load balancer asks for, kept on the request's HTTP span
        Request(4.0, "/v1/completions", {"model": MODEL, "prompt": "Readability counts.", "max_tokens": 8,
                                          "temperature": 0.0}, headers={"endpoint-load-metrics-format": "json"}),
    ]
    return Recording("cases", "four requests one after the other: n=2 with seeds, a client leaving mid-stream, a "
                     "structured output, an ORCA load report", ["--enable-server-load-tracking"], workload)


def pooling() -> Recording:
    """Embeddings of texts of ~10 to ~300 tokens, arriving over ~0.3 s, on the built-in model served as an embedding
    model: each request is prefill steps, in chunks where it is long, and done."""
    rng = random.Random(11)
    workload, at = [], 0.0
    for num_chars in (80, 1100, 40, 300, 900, 120, 60, 500):
        workload.append(Request(at, "/v1/embeddings", {"model": MODEL, "input": zen_text(rng, num_chars)}))
        at += rng.expovariate(30.0)
    workload.append(Request(at, "/v1/embeddings", {"model": MODEL, "input": [zen_text(rng, n) for n in (50, 70, 90)]}))
    return Recording("pooling", "9 embedding requests (one of three inputs) arriving over time, the built-in model "
                     "served as an embedding model (--runner pooling) with a 64-token step budget",
                     ["--runner", "pooling", "--max-num-batched-tokens", "64"], workload)


def lora() -> Recording:
    """Completions under two adapters and the base model, arriving together: steps that mix them."""
    rng = random.Random(13)
    workload = [Request(0.02 * i, "/v1/completions", {
        "model": model, "prompt": zen_text(rng, rng.choice((60, 200, 400))), "max_tokens": rng.choice((8, 16, 24)),
        "temperature": 0.0, "ignore_eos": True}) for i, model in enumerate([MODEL, "sql", "chat"] * 3)]
    return Recording("lora", "9 completions, 3 each under the base model and two LoRA adapters (random, rank 8, "
                     "made for the built-in model by PEFT), arriving within 0.2 s: steps mix the adapters",
                     ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-num-batched-tokens", "128"],
                     workload, adapters=("sql", "chat"))


def lora_gate() -> Recording:
    """Requests of two adapters arriving together on a server with one adapter slot (--max-loras 1): a chat
    request waits while sql requests run, and base-model requests that came after it start before it."""
    rng = random.Random(23)
    models = ["sql", "chat", MODEL, "sql", MODEL, "chat"]
    workload = [Request(0.02 * i, "/v1/completions", {
        "model": model, "prompt": zen_text(rng, 80), "max_tokens": 16 if model == "sql" else 8,
        "temperature": 0.0, "ignore_eos": True}) for i, model in enumerate(models)]
    return Recording("lora-gate", "6 completions within 0.1 s, two each under the base model and two LoRA "
                     "adapters (recorded-lora's), on a server with one adapter slot (--max-loras 1): the scheduler "
                     "holds a request back while the other adapter runs", ["--enable-lora", "--max-loras", "1",
                     "--max-lora-rank", "8", "--max-num-batched-tokens", "128"], workload, adapters=("sql", "chat"))


VISION_MODEL = "tinyserve-vision"  # the built-in vision model (tinyserve/models/default_model.py)
ENCODER_BUDGET = 512  # image rows a step may encode: two of the built-in vision model's images (256 rows each)


def image_chat(at_s: float, parts: list[str], max_tokens: int = 16) -> Request:
    """A chat of one user message whose parts are pictures (recording_pictures.py, by name, as data URLs) and text."""
    content = [{"type": "image_url", "image_url": {"url": data_url(part)}} if part in PICTURES
               else {"type": "text", "text": part} for part in parts]
    body = {"model": VISION_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0}
    return Request(at_s, "/v1/chat/completions", body)


def multimodal() -> Recording:
    """One image request alone; the same image again after other text (the encoder cache, not the prefix cache,
    serves it); a burst of six images and two text-only chats, which the encoder budget spreads over steps;
    two images in one prompt, both in the encoder cache by then."""
    question = "What is in this picture?"
    burst = ["blue-square", "green-stripes", "sunset", "checkers", "two-dots", "house"]
    workload = [image_chat(0.0, ["red-circle", question]), image_chat(1.0, ["Look again.", "red-circle", question]),
                *(image_chat(2.0 + 0.01 * i, [name, question]) for i, name in enumerate(burst)),
                *(image_chat(2.005 + 0.02 * i, [text]) for i, text in enumerate(["Which is better, flat or nested?",
                                                                                  "What counts?"])),
                image_chat(4.0, ["red-circle", "green-stripes", "Which is larger?"])]
    return Recording("multimodal", "image chats on the built-in vision model: one alone, the same image again after "
                     "other text, a burst of six images beside two text-only chats with a 512-row encoder budget, and "
                     "two images in one prompt; a pool of 160 KV blocks, so that the block map is legible",
                     [VISION_MODEL, "--max-num-encoder-input-tokens", str(ENCODER_BUDGET), "--num-kv-blocks", "160"],
                     workload, model=VISION_MODEL)


SPECULATIVE_CONFIG = {"method": "draft_model", "num_speculative_tokens": 3}  # the built-in draft


def spec_decode() -> Recording:
    """Chat requests one after the other on the built-in model with its built-in draft: each request alone in its steps,
    so every step's drafts are its own."""
    questions = ["Which is better, flat or nested?", "What counts?", "Is explicit better than implicit?",
                 "What about errors?"]
    workload = [Request(1.0 * i, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0.0})
        for i, question in enumerate(questions)]
    return Recording("spec-decode", "4 chat requests one after the other, greedy, on the built-in model with "
                     "speculative decoding by its built-in draft (3 tokens a step)",
                     ["--speculative-config", json.dumps(SPECULATIVE_CONFIG, separators=(",", ":"))], workload)


PD_FLAGS = ["--max-num-batched-tokens", "128", "--max-num-seqs", "16"]


def pd_workload() -> list[Request]:
    """Many decodes and long prompts beside them: 8 completions of short prompts asked for 64 tokens each within
    0.1 s, then 6 prompts of ~400 tokens asked for 4 tokens, one every 0.1 s while those decode."""
    rng = random.Random(17)
    workload = [completion(0.0125 * i, zen_text(rng, 60), 64) for i in range(8)]
    return workload + [completion(0.15 + 0.1 * i, zen_text(rng, 1600), 4) for i in range(6)]


def pd_colocated() -> Recording:
    return Recording("pd-colocated", "the disaggregation workload (8 decodes of 64 tokens, 6 prompts of ~400 tokens "
                     "arriving among them) on two ordinary servers behind nginx (least_conn), each prefilling and "
                     "decoding, 128-token step budget", PD_FLAGS, pd_workload(), routed_ranks=2,
                     warm_up_chars=1600)


def pd_disaggregated() -> Recording:
    return Recording("pd-disaggregated", "the same workload on a prefill server and a decode server (--kv-transfer-"
                     "config kv_producer and kv_consumer) behind `tinyserve router --prefill --decode`; the router's and "
                     "the decode server's runs merged, and the prefill server's in its prefill/ folder", PD_FLAGS, pd_workload(), disaggregated=True, warm_up_chars=1600)


def make_adapter(folder: Path, seed: int) -> Path:
    """A rank-8 LoRA adapter of the built-in model on every projection, made by PEFT (random A and B from `seed`;
    PEFT starts B at zero, which would change nothing), saved in PEFT's format into `folder`: the same bytes
    of weights from the same seed on every machine. The run keeps a copy (adapters/<name>/); of what PEFT
    writes it keeps the weights and the config, whose base model is named, not the path it had here."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tinyserve.models.default_model import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = BASE_MODEL_NAME
    config["target_modules"] = sorted(config["target_modules"])  # PEFT writes a set: its order varies by process
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


ADAPTER_CONFIG = "adapter_config.json"
BASE_MODEL_NAME = "tinyserve built-in model (tinyserve/models/default-model)"


RECORDINGS = {r.name: r for r in (lifecycle(), mixed(), kv_tight(), kv_roomy(), kv_no_prefix_cache(), load(5), load(25),
                                  load(75), load_dp(), load_api2(), load_tp(), multi_node(), external_lb(), cases(), node_lost(),
                                  pooling(), lora(), lora_gate(), spec_decode(), least_load(), routed_by("prefix-aware"),
                                  routed_by("round-robin"), pd_colocated(), pd_disaggregated(),
                                  pipeline(), multimodal())}


# ---- the server and the client ------------------------------------------------------------


async def send(client: httpx.AsyncClient, start: float, request: Request, allow_errors: bool = False,
               backends: list[str] = ()) -> None:
    await asyncio.sleep(max(0.0, start + request.at_s - time.monotonic()))
    url = request.path if request.backend is None else backends[request.backend] + request.path
    async with client.stream("POST", url, json=request.body, headers=request.headers) as response:
        if request.disconnect_after is not None:  # read a few lines, then close the connection mid-stream
            lines = response.aiter_lines()
            for _ in range(request.disconnect_after):
                await anext(lines)
            return
        body = await response.aread()  # a streamed answer is read to its last event, like a client would
    if response.status_code != 200 and not allow_errors:
        raise RuntimeError(f"{request.path} answered {response.status_code}: {body[:500]!r}")


async def drive(url: str, workload: list[Request], kill_node=None, kill_at_s: float | None = None,
                backends: list[str] = ()) -> None:
    """Send the workload; with kill_node, kill the headless node kill_at_s into it (its requests may then fail).
    backends: each rank's own URL, behind the router at `url` (a request with a backend goes there)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        start = time.monotonic()
        sends = [send(client, start, request, kill_node is not None, backends) for request in workload]
        if kill_node is not None:
            async def kill() -> None:
                await asyncio.sleep(kill_at_s)
                kill_node()
            sends.append(kill())
        await asyncio.gather(*sends)


def as_logged(request: Request) -> dict:
    """A request as recording.json keeps it: headers and disconnect_after only where it has them."""
    return {key: value for key, value in asdict(request).items()
            if value is not None or key not in ("headers", "disconnect_after", "backend")}


def run_workload(url: str, workload: list[Request], kill_node=None, kill_at_s: float | None = None,
                 backends: list[str] = ()) -> None:
    """Drive the workload on an event loop of its own thread: the caller may be running one (a Jupyter kernel is)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(asyncio.run, drive(url, workload, kill_node, kill_at_s, backends)).result()


def chat_once(url: str, chat: dict) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    stream = client.chat.completions.create(model=MODEL, **chat)
    for _ in stream:
        pass


def model_fingerprint(model: str = MODEL) -> str:
    """sha256 over the built-in model's weights and tokenizer (or the named built-in model's): replay matches only
    on the same model."""
    from tinyserve.models import default_model
    from tinyserve.models.loader import resolve_model_path

    return default_model.model_fingerprint(resolve_model_path(model))


def warm_up(url: str, engines: int = 1, pooling: bool = False, prompt: str = "Warm up.",
            model: str = MODEL) -> list[str]:
    """One tiny request per engine before the workload, sent together (the load balancer gives
    each engine one): the first forward pass of a fresh engine pays for allocating and tuning
    its kernels (~0.4 s on a CPU), which is no part of what the notebooks show. Returns their
    response ids, so drop_requests can take them out of the run."""
    body, path = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}, "/v1/completions"
    if pooling:  # a pooling server (--runner pooling) computes embeddings only
        body, path = {"model": model, "input": "Warm up."}, "/v1/embeddings"
    if model == VISION_MODEL:  # the image encoder warms up too
        body, path = image_chat(0, ["warm-up", prompt], max_tokens=2).body, "/v1/chat/completions"

    def one(_) -> str:
        response = httpx.post(f"{url}{path}", json=body, timeout=300)
        response.raise_for_status()
        return response.json()["id"]

    with concurrent.futures.ThreadPoolExecutor(engines) as pool:
        return list(pool.map(one, range(engines)))


def engine_count(flags: list[str]) -> int:
    return int(flags[flags.index("--data-parallel-size") + 1]) if "--data-parallel-size" in flags else 1


def drop_requests(run_dir: Path, response_ids: set[str]) -> None:
    """Remove these requests from a run folder: their traces, and the step traces that served only them."""
    from tinyserve.lifecycle import schema
    from tinyserve.trace_reading.otlp_json import read_spans

    files = sorted(run_dir.glob("*.jsonl"))
    spans = [span for path in files for span in read_spans(path)]
    dropped = {s.trace_id for s in spans if s.attributes.get(schema.GEN_AI_RESPONSE_ID) in response_ids}
    engine_ids = {s.attributes[schema.REQUEST_ID] for s in spans
                  if s.trace_id in dropped and schema.REQUEST_ID in s.attributes}
    # The steps that served only them, and the empty ones that only released them, with their phases. A
    # step shares its trace with the engine's other steps of that minute (their timeline span): by span id.
    steps = {s.span_id for s in spans if s.name == schema.STEP
             and set(s.attributes.get(schema.STEP_REQUEST_IDS, [])
                     or s.attributes.get(schema.STEP_RELEASED_REQUEST_IDS, [])) <= engine_ids}
    while more := {s.span_id for s in spans if s.parent_span_id in steps} - steps:  # their phases, and inside those
        steps |= more

    def kept(span: dict) -> bool:
        return span["traceId"] not in dropped and span["spanId"] not in steps

    for path in files:
        lines = []
        for line in path.read_text().splitlines():
            export = json.loads(line)
            for resource_spans in export["resourceSpans"]:
                for scope_spans in resource_spans["scopeSpans"]:
                    scope_spans["spans"] = [s for s in scope_spans["spans"] if kept(s)]
                resource_spans["scopeSpans"] = [s for s in resource_spans["scopeSpans"] if s["spans"]]
            export["resourceSpans"] = [r for r in export["resourceSpans"] if r["scopeSpans"]]
            if export["resourceSpans"]:
                lines.append(json.dumps(export, separators=(",", ":")))
        path.write_text("".join(line + "\n" for line in lines))
    hashes = {h for s in spans if s.trace_id not in dropped and s.span_id not in steps
              for h in s.attributes.get(schema.MM_HASHES, [])}
    for image in sorted((run_dir / schema.RUN_IMAGES_DIR).glob("*")):  # the dropped requests' own images
        if image.stem not in hashes:
            image.unlink()


def keep_prefill_run(scratch: Path, run_dir: Path, warm_up_prompt: str) -> None:
    """A disaggregated run's prefill server's own run, in its prefill/ folder (a run of its own: its requests
    are the decode server's again), the warm-up taken out as from the decode server's."""
    from tinyserve.trace_reading import load_run

    prefill = next((scratch / "prefill").iterdir())
    drop_requests(prefill, {r.request_id for r in load_run(prefill).requests if r.inputs.prompt == warm_up_prompt})
    shutil.move(str(prefill), run_dir / "prefill")


def record(name: str, out_dir: str | Path) -> Path:
    """Record one run of RECORDINGS into <out_dir>/recorded-<name>/ (replacing it) and return that folder."""
    if name not in RECORDINGS:
        raise ValueError(f"name must be one of {sorted(RECORDINGS)}, got {name!r}")
    recording = RECORDINGS[name]
    target = Path(out_dir) / f"recorded-{name}"
    with tempfile.TemporaryDirectory(prefix="tinyserve-record-") as scratch:
        adapters = [f"{name}={make_adapter(Path(scratch) / 'adapters' / name, seed)}"
                    for seed, name in enumerate(recording.adapters, start=1)]
        flags = [*recording.flags, *(["--lora-modules", *adapters] if adapters else [])]
        with deployment(Path(scratch), flags, recording.headless_flags, recording.routed_ranks,
                        recording.router, recording.disaggregated) as (url, kill_node, backends):
            long_prompt = zen_text(random.Random(0), recording.warm_up_chars) if recording.warm_up_chars else "Warm up."
            warm_up_ids = warm_up(url, engines=max(recording.routed_ranks, engine_count(recording.flags)),
                                  pooling="pooling" in recording.flags, prompt=long_prompt, model=recording.model)
            if recording.single_chat is not None:
                chat_once(url, recording.single_chat)
            elif recording.kill_node_at_s is not None:
                run_workload(url, recording.workload, kill_node, recording.kill_node_at_s)
            else:
                run_workload(url, recording.workload, backends=backends)
        run_dir = run_folder(Path(scratch))
        drop_requests(run_dir, {i for warm_up_id in warm_up_ids for i in (warm_up_id, f"{warm_up_id}-0")})
        if recording.disaggregated:
            keep_prefill_run(Path(scratch), run_dir, long_prompt)
        if adapters:  # the run replays anywhere: its adapters go with it, where replay looks for them
            shutil.copytree(Path(scratch) / "adapters", run_dir / ADAPTERS_FOLDER)
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(run_dir), target)
    env = [f"{key}={value}" for key, value in SERVER_ENV.items()]
    hosts = recording.headless_flags is not None  # one machine plays two hosts: their spans say which
    command = [*env, *([f"OTEL_RESOURCE_ATTRIBUTES=host.name={HEAD_HOST}"] if hosts else []),
               "tinyserve", "serve", "--trace", "--trace-dir", "traces", *map(shlex.quote, recording.flags),
               *(["--lora-modules", *(f"{name}=adapters/{name}" for name in recording.adapters)]
                 if recording.adapters else [])]
    if recording.routed_ranks:
        front = ["nginx  # least_conn in front (scripts/recording_servers.py)"] if recording.router is None else [
            "tinyserve", "router", "--trace", "--trace-dir", "traces", "--backend", "RANK_0_URL", "RANK_1_URL",
            *map(shlex.quote, recording.router)]
        command = [part for rank in range(recording.routed_ranks) for part in
                   (*command, "--data-parallel-size", str(recording.routed_ranks), "--data-parallel-rank", str(rank),
                    "&")] + front
    if recording.disaggregated:
        command = [part for role in ("kv_producer", "kv_consumer") for part in
                   ("TINYSERVE_KV_TRANSFER_SECRET=$SECRET", *command, "--kv-transfer-config",
                    f"'{{\"kv_role\": \"{role}\"}}'", "--port", str(8001 + (role == "kv_consumer")), "&")]
        command += ["tinyserve", "router", "--trace", "--trace-dir", "traces", "--prefill", "http://127.0.0.1:8001",
                    "--decode", "http://127.0.0.1:8002", "# the router's and the decode server's runs merged"]
    if recording.headless_flags is not None:
        command += ["&", *env, f"OTEL_RESOURCE_ATTRIBUTES=host.name={NODE_HOST}", "tinyserve", "serve", "--headless",
                    "--trace", "--trace-dir", "traces", *recording.headless_flags]
        if recording.kill_node_at_s is not None:
            command += [f"# the node killed with SIGKILL {recording.kill_node_at_s} s into the workload"]
    if recording.adapters:
        command += ["# adapters/<name>: random PEFT adapters, seeded (scripts/record_traces.py: make_adapter), "
                    "copied into the run folder; the spans log the temporary folder they were served from"]
    about = {
        "name": name, "description": recording.description, "command": " ".join(command),
        "model_fingerprint": model_fingerprint(recording.model), "python": sys.version.split()[0],
        "single_chat": recording.single_chat, "workload": [as_logged(r) for r in recording.workload],
    }
    (target / RECORDING_FILE).write_text(json.dumps(about, indent=1) + "\n")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"runs to record (default: all of {', '.join(RECORDINGS)})")
    parser.add_argument("--out", default=str(ROOT / "traces"), help="folder for the recorded-<name> run folders")
    args = parser.parse_args()
    for name in args.names or RECORDINGS:
        started = time.monotonic()
        target = record(name, args.out)
        size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
        print(f"{target}: {size / 1e6:.2f} MB in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
