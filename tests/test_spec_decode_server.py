"""`tinyserve serve --speculative-config`: the engine process speculates, /metrics counts it, and the reading
path's speculative-decoding entries are what it runs (line coverage of the server's processes)."""

import json

import httpx
import pytest

from tests.reading_path_entries import LineCoverage, never_ran, sections
from tests.server_checks import metric, wait_until
from tests.spec_checkpoints import repeating_checkpoint
from tinyserve import LLM, SamplingParams
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

SECTION = "Several tokens a step: speculative decoding (`--speculative-config`)"  # docs/reading_path.md's
PROPOSERS = {"ngram": "tinyserve/spec_decode/ngram_proposer.py:NgramProposer.propose_one",
             "draft_model": "tinyserve/spec_decode/draft_model_proposer.py:DraftModelProposer.propose"}


def section_entries_never_ran(method: str, measured: LineCoverage) -> list[str]:
    """The section's entries a server speculating by `method` ran none of (the other method's proposer aside)."""
    others = [entry for name, entry in PROPOSERS.items() if name != method]
    return never_ran([entry for entry in sections()[SECTION] if entry not in others], measured.executed())


def test_a_server_with_a_speculative_config_answers_as_without_and_counts_its_drafts(tmp_path):
    folder = repeating_checkpoint()
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    measured = LineCoverage(tmp_path)
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--speculative-config", json.dumps(config),
                           env=measured.env, startup_timeout=300)
    try:
        # Registered at start-up, before any draft (vLLM's series)
        assert "tinyserve:spec_decode_num_drafts_total" in httpx.get(f"{server.url}/metrics", timeout=10).text
        prompt = [9, 4, 7, 7, 7]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0.0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        plain = LLM(str(folder)).generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0,
                                                                                         max_tokens=24), use_tqdm=False)
        assert answer["choices"][0]["text"] == plain[0].outputs[0].text
        wait_until(lambda: metric(server.url, "spec_decode_num_drafts_total") > 0, 10, "drafts are counted")
        drafted = metric(server.url, "spec_decode_num_draft_tokens_total")
        assert metric(server.url, "spec_decode_num_accepted_tokens_total") == drafted > 0
        assert metric(server.url, "spec_decode_num_accepted_tokens_per_pos_total") == drafted
    finally:
        server.stop()
    assert section_entries_never_ran("ngram", measured) == []


def test_the_built_in_draft_over_http_gives_transformers_tokens_under_concurrent_requests(tmp_path):
    """draft_model without a model: the built-in draft. Greedy token ids equal transformers' own generate."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.hf_reference import MAX_TOKENS, hf_greedy
    from tinyserve.models.default_model import default_model_path

    config = {"method": "draft_model", "num_speculative_tokens": 3}
    measured = LineCoverage(tmp_path)
    server = ServerProcess(None, "--speculative-config", json.dumps(config), env=measured.env, startup_timeout=300)
    try:
        prompts = [[9, 120, 33, 41, 7], [250, 3, 18, 77, 140, 201, 9], [5, 6, 7, 8], [1000, 2000, 3000]]

        def token_ids(prompt):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0,
                    "return_tokens_as_token_ids": True}
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(token_ids, prompts))
        assert got == [hf_greedy(str(default_model_path()), p) for p in prompts]
        wait_until(lambda: metric(server.url, "spec_decode_num_drafts_total") > 0, 10, "drafts are counted")
    finally:
        server.stop()
    assert section_entries_never_ran("draft_model", measured) == []
