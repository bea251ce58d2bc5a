"""Measure the built-in draft model against the built-in model, with transformers, on the CPU.

    .venv/bin/python scripts/measure_default_draft.py                 the shipped draft
    .venv/bin/python scripts/measure_default_draft.py --draft /tmp/d  another one

Speculative decoding gains by the target's agreement with its draft. Along the built-in
model's own greedy generations (64 new tokens, stopping at an end token, after each of 32
prompts: 12 prefixes of the built-in model's training text, 8 of the other modules'
docstrings, 12 chat turns), it prints:

- the greedy agreement: the fraction of positions where the draft's greedy next token is
  the built-in model's (the chance a first drafted token is accepted, with greedy sampling);
- for k = 3 drafted tokens, the chance that the first j drafts all match (j = 1, 2, 3), and
  the expected number of tokens a verification step yields (accepted drafts plus the
  target's own one);
- the time per token of a one-token decode step with a KV cache, of each model, and their ratio.

The prompts come from other seeds than the draft's training prompts (seed 1).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tinyserve.models import corpus, default_model

NEW_TOKENS = 64
PROMPT_TOKENS = 16
K = 3
SEED = 1234
TRAINING_MODULES = ("textwrap", "queue", "contextlib")


def prompts(tokenizer) -> list[list[int]]:
    """32 prompts: 12 from the built-in model's training text, 8 from other docstrings, 12 chat turns."""
    generator = torch.Generator().manual_seed(SEED)
    zen = corpus.zen_of_python()
    others = [m for m in corpus.stdlib_modules() if m not in TRAINING_MODULES]

    def prefixes(texts: list[str], count: int) -> list[list[int]]:
        ids = [i for text in texts for i in tokenizer.encode(text) + [tokenizer.eos_token_id]]
        starts = torch.randint(0, len(ids) - PROMPT_TOKENS, (count,), generator=generator).tolist()
        return [ids[s : s + PROMPT_TOKENS] for s in starts]

    result = prefixes(corpus.stdlib_docstrings(TRAINING_MODULES), 12) + prefixes(corpus.stdlib_docstrings(others), 8)
    # chats: 8 Zen aphorisms (as the built-in model was taught to answer) and 4 docstrings' first lines
    questions = [zen[i] for i in torch.randperm(len(zen), generator=generator)[:8].tolist()]
    docs = corpus.stdlib_docstrings(others)
    questions += [docs[i].splitlines()[0] for i in torch.randperm(len(docs), generator=generator)[:4].tolist()]
    for question in questions:
        messages = [{"role": "user", "content": question}]
        result.append(
            list(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
        )
    return result


def matches(draft, target, prompt: list[int]) -> list[bool]:
    """Whether the draft's greedy next token is the target's, at each position of the target's greedy generation."""
    input_ids = torch.tensor([prompt])
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=target.generation_config.eos_token_id,
        pad_token_id=target.config.pad_token_id,
    )
    with torch.no_grad():
        sequence = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        generated = sequence[0, len(prompt) :]
        draft_next = draft(input_ids=sequence[:, :-1]).logits[0, len(prompt) - 1 :].argmax(-1)
    return (draft_next == generated).tolist()


def decode_seconds_per_token(model, steps: int = 64, repeats: int = 5) -> float:
    """Best-of-`repeats` seconds of a one-token forward with a KV cache, after a 32-token prefill."""
    config = GenerationConfig(
        do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=model.config.pad_token_id
    )
    input_ids = torch.arange(100, 132).unsqueeze(0)
    best = float("inf")
    with torch.no_grad():
        model.generate(input_ids, generation_config=config)  # warm up
        prefill = min(_timed(lambda: model(input_ids=input_ids, use_cache=True)) for _ in range(repeats))
        for _ in range(repeats):
            best = min(best, (_timed(lambda: model.generate(input_ids, generation_config=config)) - prefill) / steps)
    return best


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, default=None, help="draft folder (default: the shipped one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the timing (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_path = default_model.default_model_path()
    draft_path = args.draft or default_model.default_draft_path()
    target = AutoModelForCausalLM.from_pretrained(target_path, local_files_only=True, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)

    per_prompt = [matches(draft, target, prompt) for prompt in prompts(tokenizer)]
    groups = {"training text": per_prompt[:12], "other docstrings": per_prompt[12:20], "chats": per_prompt[20:]}
    for name, group in [("all", per_prompt), *groups.items()]:
        flat = [m for p in group for m in p]
        print(f"{name}: greedy agreement {sum(flat) / len(flat):.3f} over {len(flat)} positions")
    # A verification step after position t accepts draft j when drafts 1..j all match.
    accepted = [0] * K
    steps = 0
    for m in per_prompt:
        for t in range(len(m)):
            steps += 1
            for j in range(K):
                if t + j < len(m) and all(m[t : t + j + 1]):
                    accepted[j] += 1
    chances = [a / steps for a in accepted]
    print(f"k={K}: P(first j drafts accepted) " + ", ".join(f"j={j + 1}: {c:.3f}" for j, c in enumerate(chances)))
    print(f"expected tokens per verification step: {1 + sum(chances):.2f} (of {K + 1} at most)")

    parameters = {name: sum(p.numel() for p in m.parameters()) for name, m in [("target", target), ("draft", draft)]}
    times = {"target": decode_seconds_per_token(target), "draft": decode_seconds_per_token(draft)}
    for name, seconds in times.items():
        print(
            f"{name}: {parameters[name]:,} parameters, {seconds * 1e3:.2f} ms per decoded token ({args.threads} thread)"
        )
    print(f"draft is {times['target'] / times['draft']:.1f}x cheaper per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
