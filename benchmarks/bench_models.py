"""The benchmarks' model and workloads: a random-weight Llama built here, and the prompts it is timed on.

compare.py, tracing_cost.py, step_overhead.py and gpu_check.py time this model. FULL is
a ~27M-parameter Llama (8 layers, hidden 512, 8 query heads over 4 KV heads of
dimension 64, SwiGLU 1376, vocab 8192, tied embeddings), saved with a byte-level BPE
tokenizer of the same 8192 ids in a folder the caller chooses; QUICK is a tiny one for
the smoke runs of the test suite. The prompts are random token ids (no special tokens),
decoding is greedy and end-of-sequence is ignored, so every contender does exactly the
same work:

    workload A   32 prompts of 16–256 tokens, 64 new tokens each
    workload B   the same prompts, 8–128 new tokens each (varied)

    (QUICK: 4 prompts of 8–32 tokens; 8 new tokens each, or 2–8)

make_llm is tinyserve set up the way every benchmark runs it: a budget of
MAX_NUM_BATCHED_TOKENS tokens a step, blocks of BLOCK_SIZE, prefix caching off (so
that a repetition cannot reuse the previous one's KV blocks).
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: tinyserve needs no install

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tinyserve.bench.datasets import vocabulary_pool  # noqa: E402
from tinyserve.models.corpus import stdlib_docstrings, stdlib_modules, zen_of_python  # noqa: E402
from tinyserve.models.tokenizer import (  # noqa: E402
    DEFAULT_CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    save_tokenizer_files,
    train_bpe_tokenizer,
)

BYTES_PER_PARAM = 4  # fp32 everywhere
BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def layer_matmul_params(self) -> int:
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_o + k_v + 3 * self.hidden_size * self.intermediate_size

    @property
    def body_matmul_params(self) -> int:
        return self.num_layers * self.layer_matmul_params

    @property
    def head_params(self) -> int:  # the tied embedding, used as the output projection
        return self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * BYTES_PER_PARAM


FULL = Shape(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
             intermediate_size=1376)
QUICK = Shape(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
              intermediate_size=128)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        outs = sorted(set(self.output_lens))
        out_text = f"{outs[0]} new tokens each" if len(outs) == 1 else \
            f"{min(outs)}–{max(outs)} new tokens (total {self.output_tokens})"
        return (f"workload {self.name}: {len(self.prompts)} prompts of {min(lens)}–{max(lens)} tokens "
                f"(total {self.prompt_tokens}), {out_text}; greedy, EOS ignored")


def build_model(folder: str, shape: Shape, quick: bool) -> int:
    """Write a random-weight Llama and a tokenizer of the same vocabulary; return the parameter count."""
    texts = zen_of_python() if quick else zen_of_python() + stdlib_docstrings(stdlib_modules())
    tokenizer = train_bpe_tokenizer(texts, shape.vocab_size)
    if tokenizer.get_vocab_size() != shape.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} ids, the model {shape.vocab_size}")
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=tokenizer.token_to_id(SPECIAL_TOKENS[0]), eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(folder)
    save_tokenizer_files(tokenizer, folder, DEFAULT_CHAT_TEMPLATE)
    return model.num_parameters()


def make_workloads(shape: Shape, quick: bool, seed: int = 0) -> list[Workload]:
    rng = np.random.default_rng(seed)
    pool = np.asarray(vocabulary_pool(shape.vocab_size, range(len(SPECIAL_TOKENS))))
    num_prompts, (low, high), new_tokens, (out_low, out_high) = \
        (4, (8, 32), 8, (2, 8)) if quick else (32, (16, 256), 64, (8, 128))
    lens = rng.integers(low, high + 1, size=num_prompts)
    prompts = [pool[rng.integers(0, len(pool), size=n)].tolist() for n in lens]
    varied = rng.integers(out_low, out_high + 1, size=num_prompts).tolist()
    return [Workload("A", prompts, [new_tokens] * num_prompts), Workload("B", prompts, varied)]


def num_kv_blocks_for(workloads: list[Workload]) -> int:
    """Enough KV blocks for every request of the largest workload at once (and a few spare): no preemption."""
    longest = max(len(p) for p in workloads[0].prompts) + max(max(w.output_lens) for w in workloads)
    return len(workloads[0].prompts) * -(-longest // BLOCK_SIZE) + 8


def make_llm(folder: str, num_kv_blocks: int, trace_dir: str | None = None, dtype: str = "float32",
             cpu_threads: int | None = None, kv_cache_dtype: str = "auto"):
    from tinyserve import LLM

    return LLM(folder, trace_dir=trace_dir, num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE,
               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_prefix_caching=False, dtype=dtype,
               cpu_threads=cpu_threads, kv_cache_dtype=kv_cache_dtype)


def tinyserve_generate(llm, workload: Workload) -> list[list[int]]:
    """The generated token ids of every request of the workload."""
    from tinyserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
