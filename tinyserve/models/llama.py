"""The Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 in one class.

The model runner hands the model a flattened batch (every scheduled token of every
sequence in one list, no padding) and the paged KV cache; the model returns one
hidden state per token, and `compute_logits` turns the rows the sampler needs into
logits. Attention itself is delegated to an AttentionBackend, so this file holds
only the arithmetic that is the same for every backend:

    input_ids [T] ─ embed_tokens ─► h [T, hidden]
    for each layer:
        h = h + o_proj(attention(RoPE(q, k), v))      (after input_layernorm)
        h = h + down_proj(silu(gate_proj(x)) * up_proj(x))  (x = post_attention_layernorm(h))
    norm(h) ─► hidden [T, hidden]  ─ compute_logits ─► lm_head ─► logits [n, vocab] fp32

Each `h = h + ...` is done together with the norm that reads h next (`add_and_norm`):
a layer hands the next its output and the residual stream h separately, as vLLM's do, so
that on the CPU backend the add and the norm are one pass (kernels/cpu_elementwise.py),
as are silu and the product with up. The sums are the same either way.

The four families differ only in small switches, all read from the HF config:
    Qwen2:  bias on q/k/v projections (not on o_proj).
    Qwen3:  RMSNorm over each head of q and k, before RoPE.
    Llama:  optional `attention_bias` (all four projections) and `mlp_bias`.
    all:    explicit `head_dim` (may differ from hidden_size / num_heads), grouped-query
            attention, tied or untied input/output embeddings.

Parameter names mirror Hugging Face's without the leading "model." (see loader.py).
"""

import torch
from torch import nn

from tinyserve.kernels import cpu_elementwise
from tinyserve.kernels.backend import AttentionBackend
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.models.packed_linear import Linear
from tinyserve.models.pipeline_parallel import PipelineStage, PPMissingLayer
from tinyserve.models.rope import RotaryEmbedding, get_rope_parameters
from tinyserve.models.tensor_parallel import RowParallelLinear, TensorParallel, split_heads, split_width


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 then rounded back, as transformers does.

    The normalization is torch's fused `F.rms_norm`, which computes exactly those float32
    operations, bit for bit, in one op instead of five (4x faster over a 2048-token prefill
    on a CPU). A 16-bit model then rounds the normalized x before the product with the
    weight, as transformers does (the fused op with the weight would multiply first).
    Both are tested against transformers' LlamaRMSNorm, in fp32, bf16 and fp16.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # x * rsqrt(mean(x^2) + eps) in float32, rounded back, then times the weight. Handed a
        # 16-bit x, F.rms_norm computes in float32 itself and rounds once at the end: the same
        # numbers as widening x first, without the two conversions.
        return self.weight * nn.functional.rms_norm(x, self.weight.shape, None, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a residual add and the norm of its sum.

        fused: in one pass, by cpu_elementwise's kernel, where it takes the tensors (fp32 or bf16 on the CPU).
        """
        if fused and cpu_elementwise.fusable(x, residual, self.weight):
            return cpu_elementwise.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self(residual), residual


def head_dim_of(config) -> int:
    """`config.head_dim` when the checkpoint sets it, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention of one layer over the flattened batch and its paged KV cache.

    Grouped-query attention: num_heads query heads share num_kv_heads key/value heads,
    in consecutive groups (query head h reads KV head h // (num_heads / num_kv_heads)).
    Only the KV heads are stored in the cache; the backend does the sharing.

        q heads:  0 1 | 2 3        (num_heads = 4)
        kv heads:  0  |  1         (num_kv_heads = 2)
    """

    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallel | None = None, fused: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.fused = fused  # RoPE in one pass, by cpu_elementwise's kernel, where it takes the tensors
        # Under tensor parallelism, this rank's heads only (tensor_parallel.py).
        split = split_heads(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank) if tp else None
        self.num_heads = split.num_heads if split else config.num_attention_heads
        self.num_kv_heads = split.num_kv_heads if split else config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.rotary_emb = rotary_emb
        self.backend = backend

        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias or config.model_type == "qwen2"  # Qwen2 always has it
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v projections stacked into one matrix, [q; k; v] by rows: one matmul
        # instead of three. The loader copies q_proj/k_proj/v_proj into their rows.
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=attention_bias, tp=tp)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]
        rope: tuple[torch.Tensor, torch.Tensor],  # RoPE's cos and sin of each token (RotaryEmbedding.lookup)
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, heads, kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        v = qkv[:, -self.qkv_sizes[2]:].reshape(num_tokens, kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k sit side by side in each row of qkv: rotated as one tensor of
            # heads + kv_heads heads, half the ops of rotating them one by one.
            q, k = self._rotate(rope, qkv, heads + kv_heads).split([heads, kv_heads], dim=1)
        else:  # Qwen3 normalizes each head of q and k first, with a weight of its own for each
            q, k, _ = qkv.split(self.qkv_sizes, dim=-1)
            q = self.q_norm(q.reshape(num_tokens, heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, kv_heads, self.head_dim))
            q = self._rotate(rope, q.view(num_tokens, -1), heads)
            k = self._rotate(rope, k.view(num_tokens, -1), kv_heads)
        # Keys are cached *after* RoPE: a cached key never needs its position again.
        self.backend.write_kv(k, v, kv_cache, metadata)
        out = self.backend.attention(q, kv_cache, metadata, scale=self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _rotate(self, rope: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, num_heads: int) -> torch.Tensor:
        """RoPE on the first num_heads heads of each row of rows [T, W]: [T, num_heads, head_dim]."""
        if self.fused and cpu_elementwise.fusable(rows, *rope):
            return cpu_elementwise.rotate(rope, rows, num_heads, self.head_dim)
        return self.rotary_emb.rotate(rope, rows[:, :num_heads * self.head_dim].view(rows.shape[0], num_heads, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)), with gate and up in one matrix."""

    def __init__(self, config, tp: TensorParallel | None = None, fused: bool = False):
        super().__init__()
        self.fused = fused  # silu and the product in one pass, by cpu_elementwise's kernel, where it takes them
        bias = bool(getattr(config, "mlp_bias", False))
        width = split_width(config.intermediate_size, tp.size, "intermediate_size") if tp else config.intermediate_size
        # gate_proj and up_proj stacked by rows, [gate; up]: one matmul instead of two.
        self.gate_up_sizes = [width, width]
        self.gate_up_proj = Linear(config.hidden_size, 2 * width, bias=bias)
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused and cpu_elementwise.fusable(gate_up):
            return self.down_proj(cpu_elementwise.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP, each added back onto the stream.

    It takes the previous layer's MLP output and the residual stream before that output
    was added (None in the first layer, whose input is the embedding itself), and returns
    its own two: each add happens with the norm that follows it (RMSNorm.add_and_norm).
    """

    def __init__(self, config, layer_idx: int, rotary_emb: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallel | None = None, fused: bool = False):
        super().__init__()
        self.fused = fused
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, backend, tp, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp, fused)

    def forward(self, hidden, residual, rope, kv_cache, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, self.fused)
        hidden = self.self_attn(hidden, rope, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual, self.fused)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder. kv_caches[i] is layer i's slice of the paged KV pool.

    With `tp`, this rank's shard of it (tensor_parallel.py): num_heads and num_kv_heads
    are then the rank's own, and so is the KV cache the runner allocates from them.
    With `pp`, this stage's layers only (pipeline_parallel.py): the others, and the embedding
    or the norm and LM head where another stage holds them, are PPMissingLayers; num_layers
    (and so the KV cache) counts the stage's own.
    """

    def __init__(self, config, attention_backend: AttentionBackend, tp: TensorParallel | None = None,
                 pp: PipelineStage | None = None):
        super().__init__()
        self.config = config
        self.tp = tp
        self.pp = pp
        start, end = (pp.start_layer, pp.end_layer) if pp else (0, config.num_hidden_layers)
        self.num_layers = end - start
        self.head_dim = head_dim_of(config)
        self.vocab_size = config.vocab_size
        if config.num_attention_heads % config.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({config.num_key_value_heads})"
            )
        # One RoPE table shared by every layer (a submodule of each, registered once here).
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, config.max_position_embeddings, get_rope_parameters(config)
        )
        # The CPU backend brings its elementwise kernels too (kernels/cpu_elementwise.py); the others, PyTorch's ops.
        self.fused = attention_backend.name == "cpu"
        first, last = pp is None or pp.is_first, pp is None or pp.is_last
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if first else PPMissingLayer()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb, attention_backend, tp, self.fused)
            if start <= i < end else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.stage_layers = list(self.layers[start:end])  # the ones forward runs: all, or this stage's
        self.num_heads = self.stage_layers[0].self_attn.num_heads  # this rank's, under tensor parallelism
        self.num_kv_heads = self.stage_layers[0].self_attn.num_kv_heads
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else PPMissingLayer()
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False) if last else PPMissingLayer()
        if config.tie_word_embeddings and first and last:
            # Small models reuse the input embedding matrix as the output projection;
            # the checkpoint then stores it once, as model.embed_tokens.weight. (A last pipeline
            # stage without the embedding loads that matrix into its own lm_head: loader.py.)
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states; or, on a pipeline stage before the last, (hidden, residual) for the next
        stage, which hands them back here as `intermediate` in place of the embedding. inputs_embeds: rows
        in place of the lookup (transformers' `inputs_embeds`: these families scale nothing after it)."""
        if inputs_embeds is None and intermediate is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden, residual = (inputs_embeds, None) if intermediate is None else intermediate
        rope = self.rotary_emb.lookup(positions, hidden.dtype)  # the same rotation in every layer
        for layer, kv_cache in zip(self.stage_layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
        if isinstance(self.norm, PPMissingLayer):  # a stage before the last: the stream goes on
            return hidden, residual
        return self.norm.add_and_norm(hidden, residual, self.fused)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32 (sampling wants full precision)."""
        return self.lm_head(hidden).float()
