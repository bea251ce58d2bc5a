"""The Triton kernels equal the PyTorch reference (run through Triton's interpreter on the CPU).

Every batch (tests/paged_batches.py) is poisoned to catch a kernel that reads or writes
where it should not: unused cache slots, the padding block 0 and the outputs hold NaN
until the kernel runs.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.paged_batches import (
    KERNEL_CASES,
    TOLERANCE,
    case_id,
    make_paged_batch,
    reference_attention,
    run_decode_kernel,
    run_prefill_kernel,
)
from tinyserve.kernels.torch_attention import TorchAttentionBackend
from tinyserve.kernels.triton_backend import TritonAttentionBackend
from tinyserve.kernels.triton_decode_attention import decode_partials, default_num_splits
from tinyserve.kernels.triton_kv_store import store_kv
from tinyserve.kernels.triton_paged import default_fp32_dot

pytestmark = pytest.mark.interpreter
CASE_IDS = [case_id(case) for case in KERNEL_CASES]


@pytest.mark.parametrize("head_dim", [48, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_store_kv_writes_each_token_to_its_slot_and_nothing_else(head_dim, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, num_kv_heads, num_tokens = 6, 16, 2, 21
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # K and V as views into one fused projection output: strided, not contiguous.
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = fused[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)

    store_kv(key, value, kv_cache, slot_mapping)

    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(slots[0, slot_mapping], key, rtol=0, atol=0)
    torch.testing.assert_close(slots[1, slot_mapping], value, rtol=0, atol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert slots[:, untouched].isnan().all()


def test_store_kv_skips_slot_minus_one():
    # The padding rows of a CUDA-graph batch carry slot -1: nothing of theirs may land anywhere.
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 16, 2, 64
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    slot_mapping = torch.tensor([5, -1, 17, -1, -1, 63])
    key, value = torch.randn(2, 6, num_kv_heads, head_dim, generator=gen)

    store_kv(key, value, kv_cache, slot_mapping)

    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
    written = slot_mapping >= 0
    torch.testing.assert_close(slots[0, slot_mapping[written]], key[written], rtol=0, atol=0)
    torch.testing.assert_close(slots[1, slot_mapping[written]], value[written], rtol=0, atol=0)
    assert slots.isnan().sum() == 2 * (num_blocks * block_size - 3) * num_kv_heads * head_dim


@pytest.mark.parametrize("queries_per_kv, head_dim, block_size, dtype", KERNEL_CASES, ids=CASE_IDS)
def test_decode_attention_matches_reference(queries_per_kv, head_dim, block_size, dtype):
    # Ragged contexts: inside one block, exactly one block, and a partial last block.
    seq_lens = [5, block_size, 2 * block_size + 7]
    batch = make_paged_batch(
        seq_lens,
        [1, 1, 1],
        seed=head_dim + block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    torch.testing.assert_close(run_decode_kernel(batch), reference_attention(batch), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_split_k_decode_matches_reference(dtype):
    # Three splits per sequence, each of its own length: 1, 3 and 6 blocks of 16 tokens,
    # so the shortest leaves two splits empty (and those must get no weight).
    batch = make_paged_batch([3, 40, 95], [1, 1, 1], seed=7, block_size=16, dtype=dtype)
    out = run_decode_kernel(batch, num_splits=3)
    torch.testing.assert_close(out, reference_attention(batch), **TOLERANCE[dtype])


def test_split_k_cuts_each_sequence_into_splits_of_its_own_length():
    # 4 splits of 16-token blocks: 3 blocks go one to a split (the fourth empty), 4 blocks
    # fill all four, 9 blocks go 3 to a split (cdiv(9, 4)): three splits, the fourth empty.
    seq_lens, num_splits = [40, 64, 140], 4
    batch = make_paged_batch(seq_lens, [1, 1, 1], seed=12, block_size=16)
    meta = batch.metadata
    _, lse = decode_partials(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, batch.scale, num_splits,
                             fp32_dot=True)
    filled = torch.isfinite(lse).all(dim=1).sum(dim=1).tolist()  # splits holding some of each sequence's blocks
    assert filled == [3, 4, 3]


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("queries_per_kv, head_dim, block_size", [(1, 48, 16), (4, 128, 32)])
def test_decode_half_precision_dot_variant_matches_reference(queries_per_kv, head_dim, block_size, num_splits):
    # The variant a bf16 cache takes on a GPU (fp32_dot=False), on fp32 operands: the
    # interpreter multiplies those exactly, so its indexing and masking are checked here.
    batch = make_paged_batch([5, block_size, 3 * block_size + 7], [1, 1, 1], seed=head_dim + num_splits,
                             queries_per_kv=queries_per_kv, head_dim=head_dim, block_size=block_size)
    out = run_decode_kernel(batch, num_splits=num_splits, fp32_dot=False)
    torch.testing.assert_close(out, reference_attention(batch), **TOLERANCE[torch.float32])


def test_prefill_half_precision_dot_variant_on_8_warps_matches_reference():
    # The launch a bf16 cache takes on a GPU, on fp32 operands (see the decode variant's test),
    # over several 16-row query tiles and a chunk after a cached prefix.
    batch = make_paged_batch([45, 30, 20], [37, 11, 1], seed=13, num_kv_heads=2, queries_per_kv=2, head_dim=128)
    out = run_prefill_kernel(batch, block_m=16, fp32_dot=False, num_warps=8)
    torch.testing.assert_close(out, reference_attention(batch), **TOLERANCE[torch.float32])


def test_the_fp32_path_is_the_default_for_fp32_and_fp8_caches_and_under_the_interpreter():
    assert default_fp32_dot(torch.float32)
    assert default_fp32_dot(torch.float8_e4m3fn) and default_fp32_dot(torch.float8_e5m2)
    assert default_fp32_dot(torch.bfloat16) is (os.environ.get("TRITON_INTERPRET") == "1")


@pytest.mark.parametrize("queries_per_kv, head_dim, block_size, dtype", KERNEL_CASES, ids=CASE_IDS)
def test_prefill_attention_matches_reference(queries_per_kv, head_dim, block_size, dtype):
    # A fresh prompt, a chunk after a cached prefix (not block-aligned), a decode
    # token riding in the mixed batch, and a prefix-cache hit (block-aligned).
    seq_lens = [13, 30, 23, block_size + 9]
    query_lens = [13, 11, 1, 9]
    batch = make_paged_batch(
        seq_lens,
        query_lens,
        seed=head_dim * block_size,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )
    torch.testing.assert_close(run_prefill_kernel(batch), reference_attention(batch), **TOLERANCE[dtype])


def test_prefill_attention_over_several_query_tiles_matches_reference():
    # 16-row tiles: the first sequence spans three tiles, the second only one, so
    # the grid also has tiles that belong to no query and must write nothing.
    batch = make_paged_batch([45, 20], [37, 4], seed=3, num_kv_heads=1, queries_per_kv=4)
    out = run_prefill_kernel(batch, block_m=16)
    torch.testing.assert_close(out, reference_attention(batch), **TOLERANCE[torch.float32])


def test_backend_decode_batch_splits_a_long_context_and_matches_reference_backend():
    batch = make_paged_batch([9, 1100, 17], [1, 1, 1], seed=5)
    backend = TritonAttentionBackend("cpu", max_model_len=2048)
    assert backend.num_kv_splits > 1  # so the split-K path runs
    out = backend.attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out, reference_attention(batch), **TOLERANCE[torch.float32])


def test_the_split_count_follows_the_engines_context_length_not_the_batch():
    assert TritonAttentionBackend("cpu", max_model_len=128).num_kv_splits == 1
    assert TritonAttentionBackend("cpu", max_model_len=4096).num_kv_splits == default_num_splits(4096) > 1
    assert default_num_splits(1 << 20) == default_num_splits(1 << 17)  # capped


def test_backend_mixed_batch_matches_reference_backend():
    batch = make_paged_batch([9, 33, 17], [1, 6, 1], seed=6)
    out = TritonAttentionBackend("cpu", max_model_len=2048).attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(out, reference_attention(batch), **TOLERANCE[torch.float32])


def test_backend_refuses_a_block_size_its_kernels_cannot_tile():
    batch = make_paged_batch([9], [1], seed=8, block_size=8)
    with pytest.raises(ValueError, match="block_size must be a power of two >= 16"):
        TritonAttentionBackend("cpu", max_model_len=2048).attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale)


def test_backend_write_kv_matches_reference_backend():
    batch = make_paged_batch([9, 33], [9, 1], seed=11, head_dim=48, block_size=32)
    key, value = torch.randn(2, 10, 2, 48).unbind(0)
    expected = batch.kv_cache.clone()
    TorchAttentionBackend().write_kv(key, value, expected, batch.metadata)
    TritonAttentionBackend("cpu", max_model_len=2048).write_kv(key, value, batch.kv_cache, batch.metadata)
    torch.testing.assert_close(batch.kv_cache, expected, rtol=0, atol=0, equal_nan=True)


def test_triton_backend_on_cpu_without_interpreter_is_refused_with_a_clear_error():
    # Triton reads TRITON_INTERPRET when a kernel is defined (module import), so
    # the only honest way to run without it is a fresh interpreter process.
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from tinyserve.kernels.backend import get_attention_backend\n"
        "try:\n"
        "    get_attention_backend('triton', torch.device('cpu'), 2048)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    repo_root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=repo_root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "attention_backend='triton' needs a CUDA GPU, or TRITON_INTERPRET=1 to run "
        "the kernels through Triton's interpreter on the CPU"
    )
