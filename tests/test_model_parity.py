"""The model and loader compute what transformers computes, on the same checkpoint files.

Each test builds a tiny random checkpoint with transformers, loads it with tinyserve's
loader, runs a flattened batch of three prompts over a paged KV cache (block size 16,
blocks scattered over the pool), and compares the logits with transformers' own
forward pass over each prompt alone.
"""

import json
import shutil
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tests.tiny_checkpoints import LLAMA3_ROPE_PARAMETERS, tiny_checkpoint
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.backend import get_attention_backend
from tinyserve.models.loader import load_model, resolve_model_path
from tinyserve.models.rope import RotaryEmbedding, compute_inv_freq, get_rope_parameters, rotate_half

BLOCK_SIZE = 16
NUM_BLOCKS = 24
PROMPT_LENS = (5, 23, 40)  # within one block, across a boundary, across two

CHECKPOINTS = {
    "llama": dict(family="llama", tie_word_embeddings=False),
    "llama-tied": dict(family="llama", tie_word_embeddings=True),
    "llama3-rope": dict(family="llama", tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE_PARAMETERS),
    "mistral": dict(family="mistral", tie_word_embeddings=False),
    "qwen2": dict(family="qwen2", tie_word_embeddings=False),
    "qwen2-tied": dict(family="qwen2", tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", tie_word_embeddings=False),
    "qwen3-tied": dict(family="qwen3", tie_word_embeddings=True),
}


def make_prompts(vocab_size: int, lens=PROMPT_LENS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lens]


def scattered_block_tables(prompt_lens) -> list[list[int]]:
    """Give each sequence blocks taken from a shuffled pool, so none are contiguous."""
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(7)).tolist()
    tables = []
    for n in prompt_lens:
        num_blocks = -(-n // BLOCK_SIZE)
        tables.append(pool[:num_blocks])
        pool = pool[num_blocks:]
    return tables


def forward_in_steps(model, prompts, step_ends, dtype=torch.float32) -> list[torch.Tensor]:
    """Run the prompts through the model in steps, as the engine would; return logits.

    step_ends[s][i] is how far sequence i has got after step s: each step feeds every
    sequence its tokens from where the previous step stopped, in one flattened batch,
    on top of the KV cache the previous steps wrote.
    """
    kv_caches = [
        torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim, dtype=dtype)
        for _ in range(model.num_layers)
    ]
    tables = scattered_block_tables([len(p) for p in prompts])
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    done = [0] * len(prompts)
    logits = [[] for _ in prompts]
    for ends in step_ends:
        input_ids, positions, slot_mapping, query_start_loc = [], [], [], [0]
        for i, (prompt, end) in enumerate(zip(prompts, ends)):
            for pos in range(done[i], end):
                input_ids.append(prompt[pos])
                positions.append(pos)
                slot_mapping.append(tables[i][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            query_start_loc.append(query_start_loc[-1] + end - done[i])
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(ends, dtype=torch.int32),
            block_tables=block_tables,
            max_query_len=max(e - d for e, d in zip(ends, done)),
            max_seq_len=max(ends),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=list(ends),
        )
        with torch.no_grad():
            hidden = model(torch.tensor(input_ids), torch.tensor(positions), kv_caches, metadata)
            step_logits = model.compute_logits(hidden)
        for i in range(len(prompts)):
            logits[i].append(step_logits[query_start_loc[i] : query_start_loc[i + 1]])
        done = list(ends)
    return [torch.cat(chunks) for chunks in logits]


def reference_logits(path, prompts, dtype=torch.float32) -> list[torch.Tensor]:
    """transformers' logits for each prompt, run alone."""
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return [hf_model(torch.tensor([p])).logits[0].float() for p in prompts]


def load(path, dtype=torch.float32, backend="torch", **kwargs):
    model, _ = load_model(path, dtype, torch.device("cpu"), get_attention_backend(backend, torch.device("cpu"), 2048),
                          **kwargs)
    return model


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_batched_prefill_logits_match_transformers(name):
    path = tiny_checkpoint(**CHECKPOINTS[name])
    model = load(path)
    prompts = make_prompts(model.vocab_size)
    ours = forward_in_steps(model, prompts, [[len(p) for p in prompts]])
    for got, want in zip(ours, reference_logits(path, prompts)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-tied", "qwen3"])
def test_chunked_prefill_then_decode_over_cached_context_matches_transformers(name, backend):
    path = tiny_checkpoint(**CHECKPOINTS[name])
    model = load(path, backend=backend)
    prompts = make_prompts(model.vocab_size)
    # Step 1: a prefix (ending mid-block, on a block boundary, past one).
    # Step 2: the rest but the last token. Step 3: one decode token each.
    steps = [[3, 16, 17], [len(p) - 1 for p in prompts], [len(p) for p in prompts]]
    ours = forward_in_steps(model, prompts, steps)
    for got, want in zip(ours, reference_logits(path, prompts)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])  # "cpu": the fused bf16 kernels (cpu_elementwise)
@pytest.mark.parametrize("name", ["llama", "qwen3-tied"])
def test_bfloat16_logits_stay_close_to_transformers_in_bfloat16(name, backend):
    path = tiny_checkpoint(**CHECKPOINTS[name])
    model = load(path, dtype=torch.bfloat16, backend=backend)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    prompts = make_prompts(model.vocab_size)
    ours = forward_in_steps(model, prompts, [[len(p) for p in prompts]], dtype=torch.bfloat16)
    wants = reference_logits(path, prompts, dtype=torch.bfloat16)
    got, want = torch.cat(ours), torch.cat(wants)
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.9
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 0.05 * scale


def test_sharded_checkpoint_loads_every_shard():
    path = tiny_checkpoint("qwen3", tie_word_embeddings=False, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    model = load(path)
    prompts = make_prompts(model.vocab_size)
    ours = forward_in_steps(model, prompts, [[len(p) for p in prompts]])
    for got, want in zip(ours, reference_logits(path, prompts)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        LLAMA3_ROPE_PARAMETERS,
    ],
    ids=lambda p: p["rope_type"],
)
def test_rope_rotates_like_transformers(rope_parameters):
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=48, max_position_embeddings=512,
        rope_parameters=rope_parameters,
    )
    positions = torch.tensor([0, 1, 2, 17, 63, 64, 200, 511])
    q, k = torch.randn(len(positions), 4, 48), torch.randn(len(positions), 2, 48)
    hf_rope = LlamaRotaryEmbedding(config)
    cos, sin = hf_rope(q, positions[None, :])
    # transformers' layout is [batch, heads, tokens, head_dim]; ours is [tokens, heads, head_dim].
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RotaryEmbedding(48, 512, get_rope_parameters(config))
    got_q, got_k = ours(positions, q, k)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotate_is_rotate_half_bit_for_bit(dtype):
    """rotate's roll and [-sin | sin] table give x * cos + rotate_half(x) * sin, the same numbers exactly."""
    rope = RotaryEmbedding(64, 512, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.tensor([0, 3, 17, 64, 300, 511])
    x = torch.randn(len(positions), 6, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    freqs = positions[:, None].float() * compute_inv_freq(64, {"rope_type": "default", "rope_theta": 10000.0})
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]
    assert torch.equal(RotaryEmbedding.rotate(rope.lookup(positions, dtype), x), x * cos + rotate_half(x) * sin)


def test_rope_parameters_are_read_from_transformers_4_fields_too():
    old_config = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    params = get_rope_parameters(old_config)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 500000.0 and params["factor"] == 2.0


def test_unknown_rope_type_is_rejected_at_load():
    path = tiny_checkpoint(
        "llama", tie_word_embeddings=False, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    )
    with pytest.raises(ValueError, match=r"rope_type must be one of \('default', 'linear', 'llama3'\), got 'dynamic'"):
        load(path)


def copy_with_weights(tmp_path, edit) -> object:
    """A copy of the tiny llama checkpoint whose weights dict went through `edit`."""
    path = tmp_path / "edited"
    shutil.copytree(tiny_checkpoint("llama", tie_word_embeddings=False), path)
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_missing_weight_is_named(tmp_path):
    path = copy_with_weights(tmp_path, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing weights \['layers.1.mlp.up_proj.weight'\]"):
        load(path)


def test_unexpected_weight_is_named(tmp_path):
    path = copy_with_weights(tmp_path, lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected weights \['model.layers.0.extra.weight'\]"):
        load(path)


def test_unsupported_model_type_lists_supported_ones(tmp_path):
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"):
        load(tmp_path)


def test_sliding_window_shorter_than_max_model_len_is_rejected():
    path = tiny_checkpoint("mistral", tie_word_embeddings=False, sliding_window=64)
    with pytest.raises(ValueError, match="sliding window attention is not supported"):
        load(path)


def test_sliding_window_covering_max_model_len_loads_and_matches():
    path = tiny_checkpoint("mistral", tie_word_embeddings=False, sliding_window=64)
    model = load(path, max_model_len=64)
    prompts = make_prompts(model.vocab_size)
    ours = forward_in_steps(model, prompts, [[len(p) for p in prompts]])
    for got, want in zip(ours, reference_logits(path, prompts)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_resolve_model_path_accepts_a_checkpoint_folder():
    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    assert resolve_model_path(str(path)) == path


def test_resolve_model_path_rejects_a_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_path(str(tmp_path))


def test_resolve_model_path_finds_a_hub_id_in_the_local_cache(tmp_path, monkeypatch):
    # The layout huggingface_hub writes: refs/main names the snapshot folder.
    repo = tmp_path / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_checkpoint("llama", tie_word_embeddings=False), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot
    assert load(resolve_model_path("tiny-org/tiny-llama")).num_layers == 2


@pytest.mark.parametrize(("model", "says"), [
    ("/no/such/folder", "no such folder; a model is a folder of config.json"),  # no hub id: no `hf download`
    ("tiny-org/not-cached", "no such folder, and not a hub id in the local Hugging Face cache"),
])
def test_resolve_model_path_never_downloads(model, says, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=says):
        resolve_model_path(model)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_checkpoints_decode_greedily_to_varied_tokens(family):
    # Guards the test models themselves: parity on a model that repeats one token
    # forever would prove little.
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family, tie_word_embeddings=True))
    prompt = torch.tensor([make_prompts(hf_model.config.vocab_size)[0]])
    out = hf_model.generate(prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False)
    assert len(set(out[0, prompt.shape[1] :].tolist())) >= 10
