"""docs/reading_path.md: every entry is a real function, the whole path stays readable in an afternoon, the
path proper is what a chat through a real server runs, each section beside it what its flag turns on, and
docs/design.md and the README say what is there."""

import re

import httpx
import pytest

from tests.reading_path_entries import (ROOT, InProcessCoverage, LineCoverage, definition, entries, never_ran,
                                        sections)
from tests.server_checks import sse_lines
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

BUDGET_LINES = 2200
# vLLM's lifecycle names, each of which the path must pass through. (vLLM's handlers iterate AsyncLLM.generate;
# here they call its two halves, add_request and the loop over its stream, apart: entry 8 says why.)
LIFECYCLE = ["serving_chat.py:create_chat_completion", "input_processor.py:InputProcessor.make_requests",
             "AsyncLLM.add_request", "EngineCore.step", "Scheduler.schedule", "ModelRunner.execute_model",
             "OutputProcessor.process_outputs"]


def test_every_entry_is_a_function_that_exists_with_a_sentence_on_it():
    found = entries()
    assert len(found) >= 20
    missing = [f"{path}:{name}" for path, name, _ in found if definition(path, name) is None]
    assert missing == []
    assert all(sentence.rstrip().endswith(".") for _, _, sentence in found)


def test_the_path_is_within_its_budget_and_passes_through_vllms_lifecycle_names():
    found = entries()
    total = sum(node.end_lineno - node.lineno + 1 for node in (definition(p, n) for p, n, _ in found))
    assert total <= BUDGET_LINES
    named = [f"{path}:{name}" for path, name, _ in found]
    assert [name for name in LIFECYCLE if not any(entry.endswith(name) for entry in named)] == []


def test_the_readme_and_the_design_document_link_the_path():
    assert "docs/reading_path.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "reading_path.md" in (ROOT / "docs" / "design.md").read_text(encoding="utf-8")


def test_design_states_the_paths_own_counts():
    """The numbers design.md gives are the document's: the path proper's entries, and those beside it."""
    found = sections()
    proper, beside = len(found[""]), sum(len(entries_) for heading, entries_ in found.items() if heading)
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    stated = re.search(r"\[the reading path\]\(reading_path\.md\):\s+(\d+) functions.*?(\d+) more", design, re.S)
    assert stated is not None and (int(stated[1]), int(stated[2])) == (proper, beside)


def tree(document: str, heading: str) -> str:
    """The first code block after `heading` in a document of the repository."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return text.split(heading, 1)[1].split("```", 2)[1]


def test_the_readme_and_design_trees_name_every_folder_of_the_package():
    folders = {path.name for path in (ROOT / "tinyserve").iterdir() if path.is_dir() and path.name != "__pycache__"}
    readme = set(re.findall(r"^  (\w+)/", tree("README.md", "## Where things are"), re.MULTILINE))
    design = set(re.findall(r"\b(\w+)/", tree("docs/design.md", "## 2. Two processes")))
    assert (sorted(folders - readme), sorted(folders - design)) == ([], [])


# The attention entry names the CPU's default backend; where another is the default, its entry (named in the
# same sentence) stands in for it.
ATTENTION = {"cpu": "tinyserve/kernels/cpu_backend.py:CpuAttentionBackend.attention",
             "triton": "tinyserve/kernels/triton_backend.py:TritonAttentionBackend.attention",
             "torch": "tinyserve/kernels/torch_attention.py:TorchAttentionBackend.attention"}
# Sections beside the path that a plain traced server runs too; the CPU's, on a CPU, but for what needs more.
ALWAYS_ON = ("Spans built after the step", "How an engine is put together: the one assembly point")
ON_A_CPU = "On a CPU: the work around the matmuls"
NEEDS_MORE = {"tinyserve/kernels/cpu_backend.py:attend_fresh_run": "a bf16 model, two whole prompts of one length"}


@pytest.mark.server
@pytest.mark.slow
def test_a_streamed_and_a_plain_chat_through_a_real_server_run_every_entry_of_the_path_proper(tmp_path):
    """`tinyserve serve` (the built-in model, traced) under line coverage in its API process and its engine
    process: coverage's own .pth starts it in every Python process that finds COVERAGE_PROCESS_START, the
    engine's included, and each process writes its data as it exits. One plain and one streamed chat, a
    graceful stop; then every entry of the path proper has run at least one line of its body, as have the
    entries of the sections every server runs (and, on a CPU, the CPU's)."""
    import torch

    from tinyserve.kernels.backend import default_attention_backend

    measured = LineCoverage(tmp_path)
    server = ServerProcess(None, "--served-model-name", "tiny", "--trace", "--trace-dir", str(tmp_path / "traces"),
                           env=measured.env, startup_timeout=300)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 8, "temperature": 0.0}
        plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"], plain.text
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"stream": True},
                          timeout=120) as streamed:
            events = [line for line in sse_lines(streamed) if line.startswith("data: ")]
        assert streamed.status_code == 200 and len(events) > 3 and events[-1] == "data: [DONE]", events
    finally:
        log = server.stop()
    assert server.process.returncode == 0 and not server.killed, log[-3000:]
    assert measured.num_processes == 2, f"one data file from each process, the API's and the engine's: {log[-3000:]}"
    executed = measured.executed()

    found = sections()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = ATTENTION[default_attention_backend(device)]
    proper = [backend if entry == ATTENTION["cpu"] else entry for entry in found[""]]
    expected = {"": proper} | {heading: found[heading] for heading in ALWAYS_ON}
    if device.type == "cpu":
        expected[ON_A_CPU] = [entry for entry in found[ON_A_CPU] if entry not in NEEDS_MORE]
    assert ATTENTION["cpu"] in found[""]
    assert {heading: never_ran(entries_, executed) for heading, entries_ in expected.items()} == \
        {heading: [] for heading in expected}


# Each section beside the path whose flag an offline LLM turns on (its engine and front end run in this
# process), or whose entries read a shipped run, and how: each case measures itself with `measuring` entered.
# What is prepared with transformers or PEFT is made before it is entered (their imports, traced, take seconds).
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def lora(measuring: InProcessCoverage) -> None:
    from tests.lora_adapters import peft_adapter
    from tinyserve import LLM, SamplingParams
    from tinyserve.lora.request import LoRARequest

    folder = tiny_model_with_tokenizer("llama")
    adapter = LoRARequest("sql", 1, str(peft_adapter(folder, "sql")))
    with measuring:  # a request under the adapter and one without, in one batch
        LLM(str(folder), enable_lora=True).generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(**GREEDY),
                                                    use_tqdm=False, lora_request=[adapter, None])


def pooling(measuring: InProcessCoverage) -> None:
    from tinyserve import LLM

    folder = tiny_model_with_tokenizer("llama")
    with measuring:
        LLM(str(folder), runner="pooling").embed([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)


def kv_cache_events(measuring: InProcessCoverage) -> None:
    from tinyserve import LLM, SamplingParams
    from tinyserve.testing import free_port

    folder = tiny_model_with_tokenizer("llama")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"}
    with measuring:  # two full blocks of 16 tokens: a BlockStored to publish
        llm = LLM(str(folder), num_kv_blocks=16, kv_events_config=events)
        try:
            llm.generate([list(range(30, 62))], SamplingParams(max_tokens=1), use_tqdm=False)
        finally:
            llm.shutdown()


def kv_connector(measuring: InProcessCoverage) -> None:
    """A prefill engine and a decode engine, each an offline LLM, as tests/test_kv_transfer.py pairs them."""
    from tinyserve import LLM, SamplingParams
    from tinyserve.distributed.kv_transfer.trust import SECRET_ENV

    folder, prompt = str(tiny_model_with_tokenizer("llama")), [5, 17, 42, 8, 99, 3, 250, 61, 7, 12, 33]

    def engine(role: str) -> LLM:
        return LLM(folder, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": role}, num_kv_blocks=64,
                   block_size=4)

    def greedy(max_tokens: int, params: dict) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, extra_args={"kv_transfer_params": params})

    with pytest.MonkeyPatch.context() as patch, measuring:
        patch.setenv(SECRET_ENV, "the secret both engines hold")
        producer, consumer = engine("kv_producer"), engine("kv_consumer")
        try:
            [prefill] = producer.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)
            consumer.generate([prompt], greedy(4, prefill.kv_transfer_params), use_tqdm=False)
            while producer.engine_core.scheduler.held:  # the producer frees the pulled blocks at its next step
                producer.engine_core.step()
        finally:
            for llm in (producer, consumer):
                llm.engine_core.model_runner.connector.close()


def prompt_embeds(measuring: InProcessCoverage) -> None:
    import torch

    from tests.hf_reference import hf_model
    from tinyserve import LLM, SamplingParams

    folder = tiny_model_with_tokenizer("llama")
    with torch.no_grad():
        rows = hf_model(folder).get_input_embeddings()(torch.tensor([5, 6, 7])).clone()
    with measuring:
        LLM(str(folder), enable_prompt_embeds=True).generate({"prompt_embeds": rows}, SamplingParams(**GREEDY),
                                                             use_tqdm=False)


def pipeline_parallelism(measuring: InProcessCoverage) -> None:
    """Two stages: stage 0 (its runner, the batch queue, the scheduler) is this process's engine, and every
    entry of the section runs there; stage 1 is a process of its own. Two prompts in batches of 5 tokens, so
    that two batches are in flight at once, as tests/test_pipeline_parallel.py runs them."""
    from tinyserve import LLM, SamplingParams

    folder = tiny_model_with_tokenizer("llama", num_hidden_layers=3)
    with measuring:
        llm = LLM(str(folder), pipeline_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=5)
        try:
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11, 12]}],
                         SamplingParams(**GREEDY), use_tqdm=False)
        finally:
            llm.shutdown()


def reasoning(measuring: InProcessCoverage) -> None:
    """The API process's answer layers, built as `tinyserve serve --reasoning-parser qwen3` builds them (an
    offline LLM reads no reasoning: the layer is the API's), reading a streamed answer in pieces that cut its
    markers."""
    import argparse

    from tests.reasoning_checkpoints import reasoning_checkpoint
    from tinyserve.assemble import ANSWER_LAYERS
    from tinyserve.entrypoints.api.answer_layers import ReadingRequest, build_answer_layers
    from tinyserve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(reasoning_checkpoint())
    with measuring:
        layers = build_answer_layers(ANSWER_LAYERS, argparse.Namespace(reasoning_parser="qwen3"), tokenizer)
        choice = layers.reading(ReadingRequest(prompt_token_ids=[5, 6], template_kwargs=None)).choice()
        deltas = [delta for piece in ("<thi", "nk>a plan</th", "ink>the answer") for delta in
                  choice.read(piece, [], piece.endswith("answer"))]
    assert "".join(d.get("reasoning", "") for d in deltas) == "a plan", deltas
    assert "".join(d.get("content", "") for d in deltas) == "the answer", deltas


def images(measuring: InProcessCoverage) -> None:
    """A LLaVA checkpoint's prompt with an image, in chunks of 8 tokens: the second chunk finds the image in
    the encoder cache; then a chat with the same image as a data: URL."""
    import base64
    import io

    from tests.llava_checkpoints import image, llava_checkpoint
    from tinyserve import LLM, SamplingParams

    folder, picture, png = str(llava_checkpoint()), image(0), io.BytesIO()
    picture.save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with measuring:
        llm = LLM(folder, max_num_batched_tokens=8)
        llm.generate({"prompt": "a <image> b", "multi_modal_data": {"image": picture}}, SamplingParams(**GREEDY),
                     use_tqdm=False)
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                               {"type": "text", "text": "b"}]}], SamplingParams(**GREEDY),
                 use_tqdm=False)


def recorded_run(measuring: InProcessCoverage) -> None:
    """`tinyserve trace request` and `trace step` on a shipped run: one request's view, one step's."""
    from tinyserve.trace_reading.run import load_run
    from tinyserve.trace_reading.views import request_view, step_view

    with measuring:
        run = load_run(ROOT / "traces" / "recorded-lifecycle")
        request_view(run, run.requests[0].request_id)
        step_view(run, run.steps[0].step_id)


OFFLINE = {
    "A request under a LoRA adapter (`--enable-lora`)": lora,
    "Reading a recorded run back": recorded_run,
    "Another kind of request: pooling (`--runner pooling`)": pooling,
    "In front of several servers: KV cache events and the router (`tinyserve router`)": kv_cache_events,
    "Prefill here, decode there: the KV connector (`--kv-transfer-config`)": kv_connector,
    "Beside the path: a prompt given as embeddings (`--enable-prompt-embeds`)": prompt_embeds,
    "The layers split into stages: pipeline parallelism (`--pipeline-parallel-size`)": pipeline_parallelism,
    "Beside the path: a reasoning model's answer (`--reasoning-parser`)": reasoning,
    "Beside the path: a prompt with images (an image-text checkpoint, LLaVA)": images,
}
# The entries of those sections that only a server runs (an HTTP route, the router's process), each with the
# test that sends a request through it.
THROUGH_A_SERVER = {
    "tinyserve/entrypoints/api/serving_embedding.py:create_embedding":
        "tests/test_server_pooling.py:test_the_openai_client_gets_transformers_embeddings_for_texts_and_token_ids",
    "tinyserve/router/app.py:Router.dispatch":
        "tests/test_router.py:test_prefix_aware_routing_reaches_the_ideal_prefix_cache_hits_and_round_robin_does_not",
    "tinyserve/router/prefix_aware.py:PrefixAware.choose":
        "tests/test_router.py:test_prefix_aware_routing_reaches_the_ideal_prefix_cache_hits_and_round_robin_does_not",
    "tinyserve/router/kv_index.py:KVIndex.apply":
        "tests/test_router.py:test_prefix_aware_routing_reaches_the_ideal_prefix_cache_hits_and_round_robin_does_not",
    "tinyserve/router/pd.py:PDRouter.dispatch":
        "tests/test_kv_transfer_server.py:test_greedy_answers_through_the_router_equal_a_single_servers",
}
# Sections another test measures, under LineCoverage in a server's processes with the flag on.
MEASURED_ELSEWHERE = {
    "Several tokens a step: speculative decoding (`--speculative-config`)": tuple(
        f"tests/test_spec_decode_server.py:{test}" for test in (
            "test_a_server_with_a_speculative_config_answers_as_without_and_counts_its_drafts",
            "test_the_built_in_draft_over_http_gives_transformers_tokens_under_concurrent_requests")),
    "Several API processes on one port (`--api-server-count N`)": (
        "tests/test_api_server_count.py:test_two_api_processes_over_two_engines_answer_count_drain_and_trace",),
}
# The sections beside the path measured nowhere, and why.
NOT_MEASURED = {
    "Beside the path: the layers a request meets only when it asks for them":
        "no one flag turns it on: each entry is a request field or a failure of its own (a JSON schema, a grammar "
        "that is late, a tensor-parallel rank that hangs, a required tool call), each run by its own tests",
}


def test_every_section_beside_the_path_is_measured_or_says_why_not():
    """A new section must be placed: run by the traced server above, by an offline case here, by another test
    that measures it (MEASURED_ELSEWHERE), or named as not measured (NOT_MEASURED, each with its reason): only
    the layers a request meets when it asks (no one flag). Every test named for what is not measured here
    exists."""
    beside = set(sections()) - {""}
    measured = [set(ALWAYS_ON) | {ON_A_CPU}, set(OFFLINE), set(MEASURED_ELSEWHERE)]
    assert sum(map(len, measured)) == len(set().union(*measured)) and set().union(*measured) <= beside
    assert set(NOT_MEASURED) == beside - set().union(*measured)
    offline_entries = {entry for heading in OFFLINE for entry in sections()[heading]}
    assert set(THROUGH_A_SERVER) <= offline_entries
    named = [*THROUGH_A_SERVER.values(), *(test for tests in MEASURED_ELSEWHERE.values() for test in tests)]
    assert [test for test in named if definition(*test.split(":")) is None] == []


@pytest.mark.parametrize("heading", list(OFFLINE), ids=lambda heading: OFFLINE[heading].__name__)
def test_a_section_beside_the_path_runs_every_entry_with_its_flag_on(heading):
    """An offline LLM with the section's flag on (or a shipped run read back), under line coverage in this
    process: every entry of the section runs at least one line of its body, but those that only a server
    runs (THROUGH_A_SERVER), which do not."""
    measuring = InProcessCoverage()
    OFFLINE[heading](measuring)
    found = sections()[heading]
    assert never_ran(found, measuring.executed()) == [entry for entry in found if entry in THROUGH_A_SERVER]
