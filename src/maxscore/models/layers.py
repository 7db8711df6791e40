"""The Llama-MoE decoder's building blocks: RMSNorm, rotary position embeddings and attention.

RoPE's inverse frequencies come from transformers' RoPE functions (``ROPE_INIT_FUNCTIONS``:
default, linear, dynamic, yarn, llama3, longrope) and the attention kernel from its attention
interface (``ALL_ATTENTION_FUNCTIONS``: sdpa, flash-attention, flex, or the fp32-softmax eager
kernel here), so the model takes whatever the installed transformers offers and converted
checkpoints keep their exact numerics. :mod:`maxscore.models.modeling_llama_moe` builds the
decoder layers from these (it imports them absolutely, which its copy in a saved checkpoint
does too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.cache_utils import Cache
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

if TYPE_CHECKING:
    from maxscore.models.configuration_llama_moe import LlamaMoEConfig

__all__ = [
    "LlamaMoEAttention",
    "LlamaMoERMSNorm",
    "LlamaMoERotaryEmbedding",
    "apply_rotary",
    "attention_function",
    "eager_attention",
]


class LlamaMoERMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 (weight included) and cast back to the
    input's dtype (stable under bf16; one rounding)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(dtype)


def _default_rope_parameters(config: Any, device: Any = None, **_: Any) -> tuple[Tensor, float]:
    """Plain RoPE's inverse frequencies ``theta^(-2i / head_dim)`` (transformers' default, which
    its models define themselves rather than in ``ROPE_INIT_FUNCTIONS``)."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (config.rope_parameters["rope_theta"] ** exponent), 1.0


#: RoPE types whose frequencies depend on the sequence length (transformers recomputes them when
#: a forward goes beyond the pretraining length: ``dynamic_rope_update``).
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
#: Tables kept before the cache starts again (a generation past a dynamic RoPE's pretraining
#: length makes one per length).
_MAX_ROPE_TABLES = 64


class LlamaMoERotaryEmbedding(nn.Module):
    """RoPE tables ``cos, sin`` for ``position_ids[B, L]``, shape ``[B, 1, L, head_dim]``.

    The inverse frequencies come from transformers' RoPE functions
    (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``: ``linear``, ``dynamic``, ``yarn``,
    ``longrope``, ``llama3``) or plain RoPE, as ``config.rope_parameters`` says, so a converted
    Llama-3.x or YaRN checkpoint rotates exactly as in transformers. They are kept in a plain
    per-device cache rather than a buffer: nothing to re-initialise after meta-device
    construction, conversion or ``from_pretrained``. ``dynamic`` and ``longrope`` recompute them
    from this forward's length (``max(position_ids) + 1``, one host sync, as transformers'
    ``dynamic_rope_update``); transformers keeps a grown ``dynamic`` table until a forward is
    shorter than the pretraining length, this one follows each forward. Angles are computed in
    fp32 and scaled by the RoPE type's attention factor (YaRN's ``mscale``).
    """

    def __init__(self, config: LlamaMoEConfig) -> None:
        super().__init__()
        self.config = config
        self._tables: dict[tuple[str, str, int | None], tuple[Tensor, float]] = {}

    def _inverse_frequencies(
        self, device: torch.device, seq_len: int | None
    ) -> tuple[Tensor, float]:
        params = self.config.rope_parameters
        # The parameters are part of the key: a config changed after construction recomputes.
        key = (repr(sorted(params.items())), str(device), seq_len)
        if key not in self._tables:
            if len(self._tables) >= _MAX_ROPE_TABLES:  # dynamic RoPE: one table per length
                self._tables.clear()
            compute = ROPE_INIT_FUNCTIONS.get(params["rope_type"], _default_rope_parameters)
            inv_freq, scaling = compute(self.config, device, seq_len=seq_len)
            self._tables[key] = (inv_freq.to(device=device, dtype=torch.float32), float(scaling))
        return self._tables[key]

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        seq_len = None
        if self.config.rope_parameters["rope_type"] in _LENGTH_DEPENDENT_ROPE:
            seq_len = int(position_ids.max()) + 1
        inv_freq, scaling = self._inverse_frequencies(position_ids.device, seq_len)
        angles = position_ids.float()[..., None] * inv_freq  # [B, L, head_dim / 2]
        # Each frequency drives the pair (i, i + head_dim/2): the "split halves" RoPE layout.
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, L, head_dim]
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x[B, H, L, head_dim]`` by the RoPE angles (split-halves pairing)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def _repeat_kv(x: Tensor, num_heads: int) -> Tensor:
    """Share each of the ``x[B, kv_heads, S, hd]`` heads among ``num_heads / kv_heads`` queries."""
    b, kv_heads, s, hd = x.shape
    if kv_heads == num_heads:
        return x
    rep = num_heads // kv_heads
    return x[:, :, None].expand(b, kv_heads, rep, s, hd).reshape(b, num_heads, s, hd)


def eager_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T * scaling + mask) v`` with an fp32 softmax: transformers' eager attention
    (same signature and outputs: ``[B, L, H, hd]`` and the ``[B, H, L, S]`` weights).

    ``attention_mask``: ``None`` (plain causal, aligned to the end of the keys), a bool mask
    (True = attend) or an additive float mask (what transformers' mask builder gives for eager),
    broadcastable to ``[B, H, q_len, kv_len]``.
    """
    del kwargs  # sliding_window / position_ids: the mask already holds them
    key, value = _repeat_kv(key, query.shape[1]), _repeat_kv(value, query.shape[1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if attention_mask is None and q_len > 1:
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        scores = scores.masked_fill(~keep, float("-inf"))
    elif attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    elif attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attention_function(implementation: str | None) -> Any:
    """The attention kernel of ``attn_implementation``: our eager one, or transformers' registry
    (``ALL_ATTENTION_FUNCTIONS``: ``sdpa``, ``flash_attention_2`` / ``_3``, ``flex_attention``,
    and any kernel registered there). ``get_interface`` in the source is also how transformers
    recognises a model whose kernel ``set_attn_implementation`` may switch."""
    implementation = implementation or "sdpa"
    try:
        if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
            return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention)
        return (
            eager_attention
            if implementation == "eager"
            else ALL_ATTENTION_FUNCTIONS[implementation]
        )
    except KeyError:
        raise ValueError(
            f"attn_implementation={implementation!r} is not a registered attention kernel; use "
            f"eager or one of {sorted(ALL_ATTENTION_FUNCTIONS.keys())}"
        ) from None


class LlamaMoEAttention(nn.Module):
    """Grouped-query self-attention with RoPE and a KV cache, through transformers' attention
    interface (``config._attn_implementation``: sdpa, eager, flash-attention, flex-attention).

    Optional, for converted models: q/k/v and output biases, QK-norm (``"head"``: RMSNorm over
    each head's width with one shared weight; ``"full"``: over all heads' width, before the
    heads are split) and clamping of q/k/v (``clip_qkv``), in that order, before RoPE; a sliding
    window in the layers ``config.layer_attention`` says.
    """

    def __init__(self, config: LlamaMoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # What transformers' attention kernels read from the module they are given.
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.sliding_window = (
            config.sliding_window
            if config.layer_attention(layer_idx) == "sliding_attention"
            else None
        )
        d = config.hidden_size
        qkv_bias, out_bias = config.attention_qkv_bias, config.attention_output_bias
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=out_bias)
        self.qk_norm = config.qk_norm
        self.clip_qkv = config.clip_qkv
        if self.qk_norm is not None:
            full = self.qk_norm == "full"
            q_width = self.num_heads * self.head_dim if full else self.head_dim
            k_width = self.num_kv_heads * self.head_dim if full else self.head_dim
            self.q_norm = LlamaMoERMSNorm(q_width, config.rms_norm_eps)
            self.k_norm = LlamaMoERMSNorm(k_width, config.rms_norm_eps)

    def _project(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, H, L, hd]``, ``k``, ``v`` ``[B, kv_heads, L, hd]`` before RoPE."""
        b, length, _ = hidden_states.shape
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, length, self.num_heads, self.head_dim)
        k = k.view(b, length, self.num_kv_heads, self.head_dim)
        v = v.view(b, length, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(
        self,
        hidden_states: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The attention output ``[B, L, D]`` and, from the eager kernel, its weights."""
        b, length, _ = hidden_states.shape
        q, k, v = self._project(hidden_states)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if past_key_values is not None:
            # The cache stores rotated keys, so cached positions never need re-rotation.
            k, v = past_key_values.update(k, v, self.layer_idx)
        out, weights = attention_function(self.config._attn_implementation)(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            position_ids=position_ids,
        )
        return self.o_proj(out.reshape(b, length, -1)), weights
