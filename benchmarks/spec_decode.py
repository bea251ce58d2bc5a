"""Speculative decoding's best case, batch 1: tokens/s with and without n-gram drafts, side by side.

The model is bench_models.py's 27M-parameter Llama (tied embeddings) with every attention
o_proj and MLP down_proj zeroed and its norms at 1: the residual stream stays the last
token's embedding, so it repeats its last token for ever and every n-gram draft is right.
Each round times the same greedy request on both engines, in turn; the ratio is taken per
round and the median printed, with the acceptance counters.

    python benchmarks/spec_decode.py [--max-tokens 128] [--rounds 5] [--num-speculative-tokens 4]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_models.py, beside this file

import torch
from bench_models import FULL, build_model
from safetensors.torch import load_file, save_file

from tinyserve import LLM, SamplingParams


def make_repeating(folder: str) -> None:
    build_model(folder, FULL, quick=False)
    path = Path(folder) / "model.safetensors"
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(tensor)
    save_file(weights, path, metadata={"format": "pt"})


def tokens_per_s(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    start = time.perf_counter()
    [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return len(output.outputs[0].token_ids) / elapsed, output.outputs[0].token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        make_repeating(folder)
        common = {"device": args.device, "enable_prefix_caching": False}
        plain = LLM(folder, **common)
        config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}
        spec = LLM(folder, speculative_config=config, **common)
        prompt = [100 + i for i in range(32)] + [7, 7, 7]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        tokens_per_s(plain, prompt, params), tokens_per_s(spec, prompt, params)  # warm both
        ratios = []
        print(f"{'round':>5} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6}")
        for round_ in range(args.rounds):
            plain_rate, plain_ids = tokens_per_s(plain, prompt, params)
            spec_rate, spec_ids = tokens_per_s(spec, prompt, params)
            assert spec_ids == plain_ids, "speculative decoding changed the greedy tokens"
            ratios.append(spec_rate / plain_rate)
            print(f"{round_:>5} {plain_rate:>12.1f} {spec_rate:>12.1f} {ratios[-1]:>6.2f}")
        stats = spec.engine_core.scheduler.spec_stats
        print(f"median speed-up {statistics.median(ratios):.2f}x; drafts {stats.num_drafts}, draft tokens "
              f"{stats.num_draft_tokens}, accepted {stats.num_accepted_tokens} "
              f"({stats.num_accepted_tokens / max(stats.num_draft_tokens, 1):.0%}); mean tokens per verifying step "
              f"{1 + stats.num_accepted_tokens / max(stats.num_drafts, 1):.2f}")


if __name__ == "__main__":
    main()
