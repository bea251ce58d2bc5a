"""`tinyserve serve --speculative-config`: the engine process speculates, /metrics counts it."""

import json

import httpx
import pytest

from tests.server_checks import metric, wait_until
from tests.spec_checkpoints import repeating_checkpoint
from tinyserve import LLM, SamplingParams
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server


def test_a_server_with_a_speculative_config_answers_as_without_and_counts_its_drafts():
    folder = repeating_checkpoint()
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--speculative-config", json.dumps(config))
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
