"""Part 3 of benchmarks/gpu_check.py: one model, one workload, transformers beside tinyserve.

The model has random weights, built here. Every contender generates exactly new_tokens
tokens per prompt, greedily, with EOS *masked* until then (transformers' min_new_tokens,
tinyserve's min_tokens): EOS merely ignored would still be the argmax of some steps of
one contender and not of the other.

    transformers generate     bf16, sdpa, its default DynamicCache (the label says so)
    tinyserve                 bf16, Triton kernels, with CUDA graphs and --enforce-eager
                              (each contender at batch 1 and at batch 64: one prompt alone,
                              where the host's time per step dominates, and a full batch)
    DecodeGraphs.run alone    one decode step of the whole batch of 64 through the recorded graph,
                              timed with CUDA events: the GPU's share of a step, beside the
                              end-to-end time that includes the host (inputs, outputs)
    fp32 parity               a few prompts in fp32, transformers against tinyserve

How alike the tokens are is reported as identical sequences and as the mean length of
the prefix that matches: in bf16 on random weights, near-ties of the logits flip one
argmax in a third to a half of the sequences with no bug (transformers in fp32 against
transformers in bf16 does the same), and everything after the flip differs. The fp32
pass is where every sequence must match.
"""

import gc
import tempfile
import time
from functools import partial
from statistics import median

import numpy as np
import torch

import bench_models
from gpu_check_common import Row, device_seconds, guarded, timer_name

GPU_SHAPE = bench_models.Shape(vocab_size=8192, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                               head_dim=64, intermediate_size=2816)  # ~0.2B parameters
HF_LABEL = "transformers generate (sdpa, DynamicCache)"


def matched_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def likeness(got: list[list[int]], wants: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(got, wants))
    prefix = np.mean([matched_prefix(a, b) for a, b in zip(got, wants)])
    return f"identical {same}/{len(wants)}, mean matched prefix {prefix:.1f}/{len(wants[0])} tokens"


def hf_generate(folder: str, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype, device: torch.device,
                repeats: int) -> tuple[float, list[list[int]]]:
    """(seconds of one batched generate, the new tokens of each prompt), left-padded as generate wants."""
    return hf_generate_batches(folder, {len(prompts): prompts}, new_tokens, dtype, device, repeats)[len(prompts)]


def hf_generate_batches(folder: str, batches: dict[int, list[list[int]]], new_tokens: int, dtype: torch.dtype,
                        device: torch.device, repeats: int) -> dict[int, tuple[float, list[list[int]]]]:
    """hf_generate of each batch, the model loaded once: {batch size: (seconds, new tokens of each prompt)}."""
    from transformers import GenerationConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    pad = model.generation_config.pad_token_id
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id)
    results = {}
    for size, prompts in batches.items():
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

        def generate(input_ids=input_ids, mask=mask):
            return model.generate(input_ids, attention_mask=mask, generation_config=config)

        with torch.no_grad():
            out = generate()
            results[size] = wall_seconds(generate, device, repeats), [row[width:].tolist() for row in out]
    model = None
    free(device)
    return results


def wall_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median wall-clock seconds of fn() (a whole generate: host and device), synchronized; 0 repeats: 0."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) if times else 0.0


def free(device: torch.device) -> None:
    """What a model or engine held, back to the device: cycles collected, PyTorch's cached blocks released."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def tinyserve_llm(folder: str, dtype: str, device: torch.device, smoke: bool, enforce_eager: bool):
    from tinyserve import LLM

    return LLM(folder, dtype=dtype, device=device.type, enforce_eager=enforce_eager, enable_prefix_caching=False,
               attention_backend="triton", **({"num_kv_blocks": 64} if smoke else {"gpu_memory_utilization": 0.5}))


def tinyserve_generate(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from tinyserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def graph_step_seconds(llm, prompts: list[list[int]], new_tokens: int, device: torch.device, smoke: bool) -> tuple:
    """(seconds of DecodeGraphs.run for one decode step of the batch, the batch size), contexts mid-generation."""
    from tinyserve.kernels.metadata import AttentionMetadata

    runner = llm.engine_core.model_runner
    graphs, block_size = runner.decode_graphs, runner.block_size
    num_seqs = min(len(prompts), graphs.largest)
    seq_lens = [len(p) + new_tokens // 2 for p in prompts[:num_seqs]]
    blocks = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(runner.kv_caches[0].shape[1])[: sum(blocks)].tolist()  # any blocks: only the time counts
    tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.tensor(order[sum(blocks[:i]): sum(blocks[: i + 1])])
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(seq_lens)]
    metadata = AttentionMetadata.from_lengths([1] * num_seqs, seq_lens, tables.to(device), torch.tensor(slots))
    input_ids = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    positions = torch.tensor([n - 1 for n in seq_lens], device=device)
    return device_seconds(lambda: graphs.run(input_ids, positions, metadata), device, smoke), num_seqs


def end_to_end(device: torch.device, smoke: bool) -> list[Row]:
    from tinyserve.models.tokenizer import SPECIAL_TOKENS

    shape = bench_models.QUICK if smoke else GPU_SHAPE
    sizes, (low, high), new_tokens = ((1, 2), (8, 24), 4) if smoke else ((1, 64), (128, 512), 128)
    repeats = 1 if smoke else 3
    dtype, dtype_name = (torch.float32, "float32") if smoke else (torch.bfloat16, "bfloat16")
    rng = np.random.default_rng(0)
    pool = np.arange(len(SPECIAL_TOKENS), shape.vocab_size)
    prompts = [rng.choice(pool, size=n).tolist() for n in rng.integers(low, high + 1, size=max(sizes))]
    batches = {size: prompts[:size] for size in sizes}
    rows, graph_rows = [], []
    tokens: dict[tuple[int, str], list] = {}  # (batch size, contender): new tokens of each prompt
    times: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory(prefix="tinyserve-gpu-check-") as folder:
        num_params = bench_models.build_model(folder, shape, quick=smoke)
        rows.append(Row("end to end", f"model: {num_params / 1e6:.0f}M-parameter Llama, {dtype_name}; batches of "
                                      f"{' and '.join(map(str, sizes))} prompts of {low}-{high} tokens, exactly "
                                      f"{new_tokens} new tokens each, greedy (EOS masked until then)", ""))

        def transformers_run():
            for size, (seconds, new) in hf_generate_batches(folder, batches, new_tokens, dtype, device,
                                                            repeats).items():
                times[size, HF_LABEL], tokens[size, HF_LABEL] = seconds, new
            return []

        rows += guarded("end to end", HF_LABEL, transformers_run)
        for name, eager in (("tinyserve (CUDA graphs)", False), ("tinyserve --enforce-eager", True)):
            graph_rows += guarded("end to end", name, lambda name=name, eager=eager: tinyserve_run(
                name, eager, folder, batches, new_tokens, dtype_name, device, smoke, repeats, tokens, times))
        rows += [compared(size, name, times, tokens, new_tokens) for size, name in times]
        rows += graph_rows
        rows += guarded("end to end", "a traced decode step", lambda: step_phases(
            folder, batches[max(sizes)], new_tokens, dtype_name, device, smoke))
        rows += guarded("end to end", "fp32 parity", lambda: fp32_parity(
            folder, prompts, new_tokens, device, smoke, {name: tokens[size, name] for size, name in tokens
                                                          if size == max(sizes)}))
    return rows


def step_phases(folder: str, prompts: list[list[int]], new_tokens: int, dtype_name: str, device: torch.device,
                smoke: bool) -> list[Row]:
    """One more generate of the largest batch with CUDA graphs, traced: where a decode step's time goes
    (the engine's schedule, execute and update spans, and the time between steps, outside EngineCore.step)."""
    from tinyserve import LLM
    from tinyserve.lifecycle.tracing import shutdown_tracing
    from tinyserve.trace_reading import load_run

    with tempfile.TemporaryDirectory(prefix="tinyserve-gpu-check-trace-") as traces:
        try:
            llm = LLM(folder, dtype=dtype_name, device=device.type, enable_prefix_caching=False,
                      attention_backend="triton", trace_dir=traces,
                      **({"num_kv_blocks": 64} if smoke else {"gpu_memory_utilization": 0.5}))
            tinyserve_generate(llm, prompts, new_tokens)
            llm.shutdown()
        finally:
            shutdown_tracing()
        steps = sorted(load_run(llm.trace_run_dir).steps, key=lambda step: step.start_ns)
    del llm
    free(device)
    decode = [(step, after) for step, after in zip(steps, steps[1:])
              if step.num_prefill_requests == 0 and step.num_requests == len(prompts)]
    if not decode:
        raise RuntimeError(f"no decode step of all {len(prompts)} sequences in the trace")
    ms = lambda values: f"{median(values) * 1e3:.2f} ms"  # noqa: E731
    phases = ", ".join(f"{name} {ms([getattr(step, name + '_s') for step, _ in decode])}"
                       for name in ("schedule", "execute", "update"))
    between = ms([(after.start_ns - step.end_ns) / 1e9 for step, after in decode])
    return [Row("end to end", f"a decode step of {len(prompts)} sequences, CUDA graphs, traced (median of "
                              f"{len(decode)})", f"{ms([step.duration_s for step, _ in decode])}: {phases}; "
                                                 f"between steps (outputs, detokenizing) {between}")]


def compared(size: int, name: str, times: dict, tokens: dict, new_tokens: int) -> Row:
    """One contender at one batch size: its throughput, against transformers' and its tokens."""
    seconds, base = times[size, name], times.get((size, HF_LABEL))
    versus = f", {base / seconds:.2f}x transformers" if base else ""
    alike = f"; {likeness(tokens[size, name], tokens[size, HF_LABEL])}" if (size, HF_LABEL) in tokens else ""
    return Row("end to end", f"batch {size}: {name}",
               f"{seconds:.2f} s, {size * new_tokens / seconds:,.0f} output tok/s{versus}{alike}")


def tinyserve_run(name, eager, folder, batches, new_tokens, dtype_name, device, smoke, repeats, tokens,
                  times) -> list[Row]:
    """Time one tinyserve contender at each batch size (into times and tokens), one engine for all of them;
    with graphs, time DecodeGraphs.run alone too, at the largest batch."""
    llm = tinyserve_llm(folder, dtype_name, device, smoke, eager)
    for size, prompts in batches.items():
        tokens[size, name] = tinyserve_generate(llm, prompts, new_tokens)
        times[size, name] = wall_seconds(partial(tinyserve_generate, llm, prompts, new_tokens), device, repeats)
    rows = []
    if not eager:
        size, prompts = max(batches.items())
        step, batch = graph_step_seconds(llm, prompts, new_tokens, device, smoke)
        per_step = times[size, name] / new_tokens
        rows.append(Row("end to end", f"DecodeGraphs.run alone: one decode step of {batch} sequences",
                        f"{step * 1e3:.2f} ms ({timer_name(device)}); end to end {per_step * 1e3:.2f} ms per generated "
                        "token of the batch, prefill and host work included"))
    llm.shutdown()
    del llm
    free(device)
    return rows


def fp32_parity(folder: str, prompts: list[list[int]], new_tokens: int, device: torch.device,
                smoke: bool, bf16_tokens: dict[str, list[list[int]]]) -> list[Row]:
    """A few prompts in fp32 through both: with no bf16 rounding, every sequence should match. Then each
    contender's bf16 tokens of those prompts (bf16_tokens, by contender) against transformers' fp32 ones:
    how far bf16 rounding alone takes transformers, beside how far it takes tinyserve."""
    few = prompts[:8]
    _, wants = hf_generate(folder, few, new_tokens, torch.float32, device, repeats=0)
    llm = tinyserve_llm(folder, "float32", device, smoke, enforce_eager=False)
    got = tinyserve_generate(llm, few, new_tokens)
    llm.shutdown()
    del llm
    free(device)
    same = sum(a == b for a, b in zip(got, wants))
    verdict = "" if same == len(few) else "FAILED: "
    rows = [Row("end to end", "fp32 parity: tinyserve (CUDA graphs) against transformers",
                f"{verdict}{likeness(got, wants)}")]
    if not smoke:  # the smoke run is fp32 throughout
        rows += [Row("end to end", f"{name} in bf16 against transformers in fp32, the first {len(few)} prompts",
                     likeness(tokens[: len(few)], wants)) for name, tokens in bf16_tokens.items()]
    return rows
