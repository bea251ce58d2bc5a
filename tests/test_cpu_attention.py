"""The CPU backend: its decode kernel reads the paged cache in place and gives the reference's numbers.

Which CPU this runs on matters for bf16: where it has AVX-512 BF16 or AMX, the reference's
bf16 attention is oneDNN's and ATen's bf16 arithmetic; elsewhere tinyserve computes it in fp32
(kernels/cpu_bf16.py). So bf16 results are checked against fp32 arithmetic on the same bf16
inputs, with a bound that follows from bf16's precision, and tests/test_cpu_kinds.py runs this
module again as the other kind of CPU (oneDNN and ATen held to AVX2 on a machine that has the
bf16 instructions; tinyserve's bf16 path forced on where it has not).
"""

import threading

import numba
import pytest
import torch
from tests.hf_reference import hf_greedy
from tests.paged_batches import make_paged_batch
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams

from tinyserve.config import KV_CACHE_DTYPES
from tinyserve.kernels.backend import default_attention_backend, get_attention_backend
from tinyserve.kernels.cpu_backend import CpuAttentionBackend, plan_cpu_step
from tinyserve.kernels.torch_attention import TorchAttentionBackend, decode_seqs

# A prefill chunk after a cached prefix, three fresh prompts of one length and two of another (each
# run attended to at once: fresh_runs), and decodes of lengths around the block edges.
SEQ_LENS = [40, 13, 13, 13, 21, 21, 30, 17, 16, 1, 64, 33]
QUERY_LENS = [11, 13, 13, 13, 21, 21, 1, 1, 1, 1, 1, 1]
# The kernel sums in fp32 and rounds its result to bf16 once: within half a bf16 step (2^-8 of the
# value) of the exact fp32 attention, plus what fp32 sums in another order move it (~1e-6).
# The reference's bf16 SDPA rounds between its stages where the CPU has bf16 instructions
# (up to ~50 half-steps off on small outputs), so it is no yardstick for the kernel's decodes.
BF16_ROUNDING = {"rtol": 2.0**-8 + 1e-6, "atol": 1e-6}


def reference(batch, dtype=None):
    # The reference's decode batch reads the padding slots (with weight 0): no NaN there.
    kv_cache = batch.kv_cache.nan_to_num(0.0).to(dtype or batch.kv_cache.dtype)
    return TorchAttentionBackend().attention(batch.query, kv_cache, batch.metadata, batch.scale)


@pytest.mark.parametrize("cache_name", ["auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_decodes_and_prefills_equal_the_reference_in_every_kv_cache_dtype(cache_name):
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, seed=3, head_dim=32)
    dtype = KV_CACHE_DTYPES[cache_name] or torch.float32
    out = CpuAttentionBackend().attention(batch.query, batch.kv_cache.to(dtype), batch.metadata, batch.scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(batch, dtype), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_name", ["auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_bf16_decodes_are_fp32_attention_rounded_once_and_prefills_are_the_references(cache_name):
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, seed=3, head_dim=32, dtype=torch.bfloat16)
    dtype = KV_CACHE_DTYPES[cache_name] or torch.bfloat16
    out = CpuAttentionBackend().attention(batch.query, batch.kv_cache.to(dtype), batch.metadata, batch.scale)
    assert out.dtype == torch.bfloat16
    decodes = torch.tensor([batch.metadata.query_start_loc_cpu[i] for i in decode_seqs(batch.metadata)])
    prefills = torch.ones(len(out), dtype=torch.bool).index_fill_(0, decodes, False)
    # The same bf16-rounded queries, keys and values, attended to in fp32.
    kv_cache = batch.kv_cache.nan_to_num(0.0).to(dtype).float()
    exact = TorchAttentionBackend().attention(batch.query.float(), kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out[decodes].float(), exact[decodes], **BF16_ROUNDING)
    torch.testing.assert_close(out[prefills], reference(batch, dtype)[prefills], rtol=0, atol=0)  # the same code


def test_whole_prompts_of_one_length_side_by_side_are_attended_to_together_in_bf16():
    batch = make_paged_batch(SEQ_LENS, QUERY_LENS, seed=3, head_dim=32)
    plan = plan_cpu_step(batch.metadata, torch.bfloat16)
    assert [[row for _, _, row in run] for run in plan.fresh_runs] == [[1, 2, 3], [4, 5]]
    assert [row for _, _, row in plan.prefills] == [0]  # the chunk after a cached prefix: one at a time
    fp32 = plan_cpu_step(batch.metadata, torch.float32)  # where one call was measured slower
    assert fp32.fresh_runs == [] and [row for _, _, row in fp32.prefills] == [0, 1, 2, 3, 4, 5]


def test_a_run_of_long_bf16_prompts_gives_the_references_bits():
    batch = make_paged_batch([300, 300, 5], [300, 300, 1], seed=4, head_dim=32, dtype=torch.bfloat16)
    assert len(plan_cpu_step(batch.metadata, torch.bfloat16).fresh_runs) == 1
    out = CpuAttentionBackend().attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    assert torch.equal(out[:600], reference(batch)[:600])


@pytest.mark.parametrize(("num_kv_heads", "queries_per_kv", "head_dim", "block_size"),
                         [(1, 1, 64, 16), (2, 4, 24, 8), (4, 2, 128, 32), (2, 7, 16, 16)])
def test_a_decode_only_step_equals_the_reference_for_any_head_layout(num_kv_heads, queries_per_kv, head_dim,
                                                                     block_size):
    seq_lens = torch.randint(1, 200, (19,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = make_paged_batch(seq_lens, [1] * 19, seed=4, num_kv_heads=num_kv_heads, queries_per_kv=queries_per_kv,
                             head_dim=head_dim, block_size=block_size)
    assert batch.metadata.is_decode_only
    out = CpuAttentionBackend().attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out, reference(batch), rtol=1e-5, atol=1e-5)


def test_the_kernel_reads_no_slot_past_a_sequences_end():
    # Every slot no sequence owns is NaN (block 0, the tails of last blocks): one read would show.
    batch = make_paged_batch([5, 16, 17, 31, 1], [1] * 5, seed=5)
    assert batch.kv_cache.isnan().any()
    out = CpuAttentionBackend().attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    assert out.isfinite().all()


def test_the_step_is_planned_once_and_the_kernels_threads_follow_torchs():
    backend, threads = CpuAttentionBackend(), torch.get_num_threads()
    first, second = make_paged_batch([9, 20, 3], [1, 1, 1], seed=6), make_paged_batch([30, 4], [5, 1], seed=7)
    try:
        for batch, count in ((first, 1), (second, 2)):
            torch.set_num_threads(count)
            plans = []
            for _ in range(2):  # two layers of one step
                out = backend.attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
                torch.testing.assert_close(out, reference(batch), rtol=1e-5, atol=1e-5)
                plans.append(backend._plan)
            assert plans[0] is plans[1]  # the second layer reused the first's
            assert numba.get_num_threads() == min(count, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(threads)


def test_two_threads_may_run_the_kernel_at_once():
    # Two engines in one process each run their steps on a thread of their own.
    batches = [make_paged_batch(torch.randint(1, 300, (24,), generator=torch.Generator().manual_seed(s)).tolist(),
                                [1] * 24, seed=s) for s in (8, 9)]
    expected = [reference(batch) for batch in batches]
    results, errors = {}, []

    def run(i):
        try:
            backend = CpuAttentionBackend()
            for _ in range(20):
                results[i] = backend.attention(batches[i].query, batches[i].kv_cache, batches[i].metadata,
                                               batches[i].scale)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert errors == []
    for i in (0, 1):
        torch.testing.assert_close(results[i], expected[i], rtol=1e-5, atol=1e-5)
    assert numba.threading_layer() in ("omp", "tbb")


def test_the_cpu_gets_this_backend_by_default_and_a_gpu_cannot_have_it():
    assert default_attention_backend(torch.device("cpu")) == "cpu"
    assert default_attention_backend(torch.device("cuda")) == "triton"
    assert isinstance(get_attention_backend("cpu", torch.device("cpu"), 2048), CpuAttentionBackend)
    with pytest.raises(ValueError, match="attention_backend='cpu' runs on the CPU only, not on cuda"):
        get_attention_backend("cpu", torch.device("cuda"), 2048)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_engine_on_the_cpu_runs_it_by_default_and_its_greedy_tokens_equal_transformers(family):
    folder = tiny_model_with_tokenizer(family)
    prompts = [[5, 9, 33, 71, 120], list(range(40, 75)), [200, 3, 17]]
    # A small token budget puts prefill chunks and decodes in one batch: both of its paths run.
    llm = LLM(str(folder), num_kv_blocks=32, max_num_batched_tokens=24)
    try:
        backends = {type(layer.self_attn.backend).__name__ for layer in llm.engine_core.model_runner.model.layers}
        assert backends == {"CpuAttentionBackend"}
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(folder, p) for p in prompts]


def test_where_the_kernel_cannot_run_the_cpu_gets_the_reference_and_the_log_says_why(monkeypatch, caplog):
    from tinyserve.kernels import cpu_decode_attention

    monkeypatch.setattr(cpu_decode_attention, "why_unusable", lambda: "ValueError: No threading layer could be loaded")
    with caplog.at_level("WARNING", logger="tinyserve.kernels.backend"):
        assert default_attention_backend(torch.device("cpu")) == "torch"
    assert "No threading layer could be loaded" in caplog.text and "using the torch backend" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_widen_in_plain_python_reads_each_cache_dtype_as_torch_widens_it(dtype):
    from tinyserve.kernels.cpu_decode_attention import _codes, widen

    values = torch.randn(64, generator=torch.Generator().manual_seed(10)).to(dtype)
    codes, table = _codes(values)
    assert [float(widen(code, table)) for code in codes] == values.float().tolist()
