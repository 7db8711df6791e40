"""Llama-MoE causal language model: Llama blocks whose MLPs are :class:`maxscore.moe.MoE` layers.

Architecture (the paper's model): token embedding, ``num_hidden_layers`` pre-norm decoder blocks
(RMSNorm → grouped-query self-attention with RoPE through
:func:`torch.nn.functional.scaled_dot_product_attention` → residual; RMSNorm → MoE or dense SwiGLU
MLP → residual), a final RMSNorm and an untied LM head.

Behaviour worth knowing:

* **Loss.** With ``labels``, ``loss`` = shifted next-token cross-entropy (``-100``, positions
  where ``attention_mask == 0`` and targets predicted from such a position are ignored) plus,
  *in training mode*, the sum over MoE layers of the router's load-balancing loss and z-loss. Those router losses are already multiplied by their
  coefficients inside the router (``config.router_aux_loss_coef`` is the router's
  ``aux_loss_coef``), so the stock HF ``Trainer`` optimises the paper's objective. In ``eval()``
  mode ``loss`` is the LM loss alone so that evaluation loss / perplexity is not polluted by a
  regulariser; the ``aux_loss`` / ``z_loss`` / ``lm_loss`` fields are always filled.
* **Causal evaluation.** Routers follow ``config.eval_routing``: in ``eval()`` mode the
  default ``"causal"`` routing never lets a token's experts depend on later tokens, so logits at
  position t do not depend on tokens after t; ``"train"`` evaluates with the training routing.
* **Padding.** Positions where a 2-D ``attention_mask`` is 0 are masked out of attention and the
  LM loss, and the mask reaches every router: padding gets no expert, takes no capacity or flow
  slot, and counts in no router loss or statistic, so the real tokens' logits, losses and
  routing do not depend on what the padding holds (in training and evaluation mode, for every
  router preset; ``tests/test_padding.py``).
* **Attention backends.** ``attn_implementation="sdpa"`` (default) runs PyTorch SDPA;
  ``"eager"`` the explicit ``softmax(q k^T / sqrt(d)) v`` in fp32 (for debugging and
  attention weights). Flash-attention and flex-attention are not implemented; transformers
  refuses them when loading, and a config switched to them afterwards raises at the first
  forward.
* **Architecture variants** (for models converted from other families,
  :mod:`maxscore.models.convert`): q/k/v and output biases, QK-norm per head or over the full
  width, q/k/v clamping, a sliding attention window, gated shared experts, dense layers at given
  indices. All off by default (Llama).
* **Statistics.** Every MoE layer keeps the detached routing statistics of the last forward
  (device tensors, no host sync); :meth:`LlamaMoEForCausalLM.routing_statistics` returns them.
* **Gradient checkpointing.** Decoder blocks are
  :class:`~transformers.modeling_layers.GradientCheckpointingLayer` and return only tensors
  (hidden states, router logits, aux loss, z-loss), so router losses keep their gradients under
  both re-entrant and non-re-entrant checkpointing.

This file is copied into saved checkpoints (``auto_map``) so that
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` works in a fresh process; it
imports its configuration relatively and ``maxscore`` absolutely.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import can_return_tuple

from maxscore.moe import DenseMLP, MoE
from maxscore.routing.router import advance_routers
from maxscore.routing.statistics import with_extra_statistics

from .configuration_llama_moe import LlamaMoEConfig

# transformers renamed the KV cache from ``past_key_values`` to ``cache`` (5.2x): in
# create_causal_mask's arguments, in the keyword ``generate`` passes to ``forward`` and in the
# output classes. We accept and emit whichever this release uses (5.17 and 5.24 are tested).
_MASK_CACHE_ARGUMENT = (
    "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
)
_OUTPUT_CACHE_FIELD = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(MoeModelOutputWithPast)}
    else "past_key_values"
)


def _output_cache(outputs: Any) -> Cache | None:
    return getattr(outputs, _OUTPUT_CACHE_FIELD)


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class LlamaMoEModelOutputWithPast(MoeModelOutputWithPast):
    """:class:`MoeModelOutputWithPast` plus the summed (already scaled) router losses.

    Attributes:
        aux_loss: sum over MoE layers of the scaled load-balancing loss (0-dim), or ``None`` for a
            dense model.
        z_loss: sum over MoE layers of the scaled router z-loss (0-dim), or ``None``.
    """

    aux_loss: Tensor | None = None
    z_loss: Tensor | None = None


@dataclass
class LlamaMoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """:class:`MoeCausalLMOutputWithPast` with the loss split into its parts.

    ``loss`` is ``lm_loss + aux_loss + z_loss`` in training mode and ``lm_loss`` in eval mode;
    ``aux_loss`` and ``z_loss`` are sums over layers of the router losses *already multiplied by
    their coefficients*.
    """

    z_loss: Tensor | None = None
    lm_loss: Tensor | None = None


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


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


def rotary_cos_sin(
    position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """RoPE tables for ``position_ids[B, L]`` -> ``cos, sin`` of shape ``[B, 1, L, head_dim]``.

    Frequencies are recomputed per call (``head_dim / 2`` values, negligible) rather than kept in a
    buffer, so nothing needs re-initialising after meta-device construction in ``from_pretrained``.
    The angles are computed in fp32 (bf16 positions would lose precision beyond ~256).
    """
    device = position_ids.device
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [head_dim / 2]
    angles = position_ids.float()[..., None] * inv_freq  # [B, L, head_dim / 2]
    # Each frequency drives the pair (i, i + head_dim/2): the "split halves" RoPE layout.
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, L, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x[B, H, L, head_dim]`` by the RoPE angles (split-halves pairing)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def _repeat_kv(x: Tensor, num_heads: int) -> Tensor:
    """Share each of the ``x[B, kv_heads, S, hd]`` heads among ``num_heads / kv_heads`` queries.

    An explicit expand + copy rather than SDPA's ``enable_gqa``, whose kernel support differs
    between torch versions and backends; a no-op for multi-head attention (the paper's models).
    """
    b, kv_heads, s, hd = x.shape
    if kv_heads == num_heads:
        return x
    rep = num_heads // kv_heads
    return x[:, :, None].expand(b, kv_heads, rep, s, hd).reshape(b, num_heads, s, hd)


#: ``attn_implementation`` values the attention layer runs (transformers' names).
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager")


def eager_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` with an fp32 softmax (transformers' eager path).

    ``mask``: ``None`` (plain causal, aligned to the end of the keys), a bool mask (True =
    attend) or an additive float mask, broadcastable to ``[B, H, q_len, kv_len]``.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    q_len, kv_len = q.shape[-2], k.shape[-2]
    if mask is None and q_len > 1:
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
        scores = scores.masked_fill(~keep, float("-inf"))
    elif mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(weights, v)


class LlamaMoEAttention(nn.Module):
    """Grouped-query self-attention with RoPE and a KV cache (PyTorch SDPA, or eager).

    Optional, for converted models: q/k/v and output biases, QK-norm (``"head"``: RMSNorm over
    each head's width with one shared weight; ``"full"``: over all heads' width, before the
    heads are split) and clamping of q/k/v (``clip_qkv``), in that order, before RoPE.
    """

    def __init__(self, config: LlamaMoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
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
    ) -> Tensor:
        b, length, _ = hidden_states.shape
        q, k, v = self._project(hidden_states)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if past_key_values is not None:
            # The cache stores rotated keys, so cached positions never need re-rotation.
            k, v = past_key_values.update(k, v, self.layer_idx)
        k, v = _repeat_kv(k, self.num_heads), _repeat_kv(v, self.num_heads)
        implementation = self.config._attn_implementation or "sdpa"
        if implementation == "eager":
            out = eager_attention(q, k, v, attention_mask)
        elif implementation == "sdpa":
            # `create_causal_mask` returns None when a plain causal (or, for one query, a full)
            # mask is exact; SDPA's `is_causal` is top-left aligned, which is right only when
            # q_len == kv_len.
            is_causal = attention_mask is None and length > 1
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, is_causal=is_causal
            )
        else:
            raise ValueError(
                f"attn_implementation={implementation!r} is not supported by the Llama-MoE model; "
                f"use one of {', '.join(ATTENTION_IMPLEMENTATIONS)}"
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


class LlamaMoEDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + Attn(Norm(x))`` then ``x + MLP(Norm(x))`` with an MoE or dense MLP.

    ``forward`` returns a tuple of tensors ``(hidden, router_logits, aux_loss, z_loss)`` (the last
    three ``None`` for a dense layer) instead of a :class:`RoutingResult`, so gradient checkpointing
    (re-entrant or not) carries the router losses' gradients. The layer's detached routing
    statistics of the last call are kept in :attr:`last_routing_stats`.
    """

    def __init__(self, config: LlamaMoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = LlamaMoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaMoEAttention(config, layer_idx)
        self.post_attention_layernorm = LlamaMoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if self.is_moe:
            self.mlp = MoE(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                intermediate_size=config.moe_intermediate_size,
                router=config.router_config,
                num_shared_experts=config.num_shared_experts,
                shared_intermediate_size=config.shared_expert_intermediate_size,
                init_std=config.initializer_range,
                shared_expert_gate=config.shared_expert_gate,
            )
        else:
            self.mlp = DenseMLP(
                config.hidden_size, config.intermediate_size, init_std=config.initializer_range
            )
        self.last_routing_stats: Mapping[str, Tensor] = {}

    def forward(
        self,
        hidden_states: Tensor,
        cos: Tensor,
        sin: Tensor,
        attention_mask: Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        token_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        del use_cache  # accepted so GradientCheckpointingLayer can switch it off; the cache decides
        h = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), cos, sin, attention_mask, past_key_values
        )
        normed = self.post_attention_layernorm(h)
        if not self.is_moe:
            return h + self.mlp(normed), None, None, None
        y, routing = self.mlp(normed, token_mask)
        # Detached device tensors only: reading them later is the caller's (single) host sync.
        # The routing statistics are lazy (evaluated when routing_statistics() reads them).
        self.last_routing_stats = with_extra_statistics(
            routing.stats, aux_loss=routing.aux_loss.detach(), z_loss=routing.z_loss.detach()
        )
        # A batch padded to whole routing groups (MoE._pad_to_whole_groups) routed extra rows.
        logits = routing.logits[: y.shape[0] * y.shape[1]]
        return h + y.to(h.dtype), logits, routing.aux_loss, routing.z_loss


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


class LlamaMoEPreTrainedModel(PreTrainedModel):
    """Shared HF plumbing: config class, init, checkpointing and attention capabilities."""

    config_class = LlamaMoEConfig
    config: LlamaMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaMoEDecoderLayer"]  # noqa: RUF012 (transformers class attribute)
    _skip_keys_device_placement = ["past_key_values"]  # noqa: RUF012
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # Routing uses data-dependent shapes in some strategies; let callers opt in to compile.
    _can_compile_fullgraph = False

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, LlamaMoERMSNorm):
            init.ones_(module.weight)
        elif not isinstance(module, nn.Linear | nn.Embedding):
            # Stacked expert weights ([e, D, F]) and other raw matrices are plain Parameters the
            # generic initialiser does not know about; give them the same N(0, std) as Linears.
            # `init.*` skips tensors that were loaded from a checkpoint.
            std = self.config.initializer_range
            for param in module.parameters(recurse=False):
                if param.dim() >= 2:
                    init.normal_(param, mean=0.0, std=std)


class LlamaMoEModel(LlamaMoEPreTrainedModel):
    """The decoder stack (embeddings → blocks → final norm), without the LM head."""

    def __init__(self, config: LlamaMoEConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaMoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> LlamaMoEModelOutputWithPast:
        """Run the decoder stack.

        Args:
            input_ids: ``[B, L]`` token ids (or give ``inputs_embeds``).
            attention_mask: ``[B, past + L]`` 1 = real token, 0 = padding (or a prepared 4D mask).
            position_ids: ``[B, L]``; default: from ``attention_mask`` (so left padding does not
                shift positions) or ``past + arange(L)``.
            past_key_values: a :class:`~transformers.DynamicCache` (created when ``use_cache``).
            use_cache: return a KV cache; default ``config.use_cache`` outside training.
            output_router_logits: return every MoE layer's ``[B*L, e]`` fp32 gate logits.
            output_hidden_states: return the input of every block plus the final output.
        """
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)  # newer transformers' name for it
        del kwargs  # HF passes extras (e.g. return_dict handled by the caller); none are used
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            # A cache is only useful for generation; don't build one in every training step.
            use_cache = self.config.use_cache and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits

        length = inputs_embeds.shape[1]
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        # Only positions the caller gave can describe packed sequences; the mask builder checks
        # them with a host sync (`find_packed_sequence_indices`), so ours are not passed to it.
        given_position_ids = position_ids
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                # Count only real tokens, so a left-padded sequence gets the positions it would
                # have unpadded (matches what `generate` passes).
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
            else:
                position_ids = torch.arange(
                    past_len, past_len + length, device=inputs_embeds.device
                )
                position_ids = position_ids.unsqueeze(0).expand(inputs_embeds.shape[0], -1)

        # transformers' mask builder: None when SDPA's is_causal is exact, else a 4D mask
        # (padding + causal, aligned to the cache; additive float for eager). A sliding window
        # gets the windowed variant.
        build_mask = create_causal_mask
        if self.config.sliding_window is not None:
            build_mask = create_sliding_window_causal_mask
        mask = build_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=given_position_ids,
            **{_MASK_CACHE_ARGUMENT: past_key_values},
        )
        cos, sin = rotary_cos_sin(
            position_ids, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype
        )

        # The routers see which positions are padding (a 2-D mask only; a prepared 4-D mask
        # carries no per-token flag).
        token_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            token_mask = attention_mask[:, -length:].bool()

        hidden = inputs_embeds
        all_hidden: list[Tensor] = []
        router_logits: list[Tensor] = []
        aux_total: Tensor | None = None
        z_total: Tensor | None = None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden)
            hidden, logits, aux, z = layer(
                hidden,
                cos,
                sin,
                attention_mask=mask,
                past_key_values=past_key_values,
                use_cache=use_cache,
                token_mask=token_mask,
            )
            if logits is not None:
                aux_total = aux if aux_total is None else aux_total + aux
                z_total = z if z_total is None else z_total + z
                if output_router_logits:
                    router_logits.append(logits)
        hidden = self.norm(hidden)
        if output_hidden_states:
            all_hidden.append(hidden)

        return LlamaMoEModelOutputWithPast(
            last_hidden_state=hidden,
            **{_OUTPUT_CACHE_FIELD: past_key_values if use_cache else None},
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            router_logits=tuple(router_logits) if output_router_logits else None,
            aux_loss=aux_total,
            z_loss=z_total,
        )


class LlamaMoEForCausalLM(LlamaMoEPreTrainedModel, GenerationMixin):
    """Llama-MoE with an LM head; computes the training loss in ``forward`` (see module docs)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012
    # The router losses are per-micro-batch means, so the Trainer must average micro-batch losses
    # itself under gradient accumulation (with loss kwargs it would sum them, scaling the router
    # losses by the accumulation steps).
    accepts_loss_kwargs = False

    def __init__(self, config: LlamaMoEConfig) -> None:
        super().__init__(config)
        self.model = LlamaMoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._compiled_loss: Any = None  # set by compile_layers
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def compile_layers(self, **compile_kwargs: Any) -> None:
        """``torch.compile`` every decoder layer in place (regional compilation).

        Fuses the elementwise work around the matrix products (RMSNorm, RoPE, residual adds, the
        router's softmax / SoftTopk, dispatch bookkeeping) that eager mode runs as hundreds of
        small kernels per layer. The layers share one compiled graph per layer type (parameters
        are graph inputs), so compiling 12 layers costs about as much as compiling one; parameter
        names and checkpoints are unchanged (no ``_orig_mod`` prefix). The language-model loss
        (fp32 upcast, log-softmax over the vocabulary, NLL) is compiled too: one fused pass
        instead of an fp32 copy of the logits and separate softmax kernels. ``compile_kwargs``
        go to ``nn.Module.compile`` (e.g. ``mode="max-autotune-no-cudagraphs"``).
        ``tests/test_model.py`` checks compiled against eager losses and gradients.

        Shapes are static by default (``dynamic=False``): a new batch or sequence size compiles
        a graph of its own instead of turning the first one into a shape-generic graph, which
        is what CUDA graphs and the autotuned kernels want. (A shape-generic graph is correct
        too: the capacity rule is exact integer arithmetic, so a symbolic group size gives the
        same capacity as eager mode; ``benchmarks/compile/README.md``.)
        """
        compile_kwargs.setdefault("dynamic", False)
        for layer in self.model.layers:
            layer.compile(**compile_kwargs)
        self._compiled_loss = torch.compile(self.loss_function, **compile_kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> LlamaMoECausalLMOutputWithPast:
        """Forward pass; see :meth:`LlamaMoEModel.forward` for the shared arguments.

        Args:
            labels: ``[B, L]`` targets aligned with ``input_ids`` (shifted internally); ``-100``
                is ignored, and so is every position where a 2D ``attention_mask`` is 0.
            logits_to_keep: compute logits only for the last ``n`` positions (0 = all), or for the
                given position indices (used by ``generate`` to skip the prompt's logits).
        """
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)  # newer transformers' name for it
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            output_hidden_states=output_hidden_states,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])

        loss = lm_loss = None
        if labels is not None:
            if attention_mask is not None and attention_mask.dim() == 2:
                pad = attention_mask[:, -labels.shape[1] :] == 0
                # A target counts only if it and the position predicting it are real tokens:
                # after left padding the first real token would be predicted from a pad.
                predicted_from_pad = F.pad(pad[:, :-1], (1, 0), value=False)
                labels = labels.masked_fill(pad | predicted_from_pad, -100)
            # transformers' causal LM loss: shift by one, fp32 cross-entropy, ignore -100.
            loss_fn = self._compiled_loss or self.loss_function
            lm_loss = loss_fn(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            loss = lm_loss
            if self.training:
                for router_loss in (outputs.aux_loss, outputs.z_loss):
                    if router_loss is not None:
                        loss = loss + router_loss.to(loss.dtype)

        return LlamaMoECausalLMOutputWithPast(
            loss=loss,
            aux_loss=outputs.aux_loss,
            logits=logits,
            **{_OUTPUT_CACHE_FIELD: _output_cache(outputs)},
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
            z_loss=outputs.z_loss,
            lm_loss=lm_loss,
        )

    # -- MoE-specific API ---------------------------------------------------------------------------

    def routing_statistics(self) -> list[dict[str, Tensor]]:
        """Per decoder layer, the detached routing statistics of the last forward.

        Entry ``i`` belongs to layer ``i`` (an empty dict for dense layers). Values are device
        tensors (see :mod:`maxscore.routing.statistics`) plus the layer's scaled ``aux_loss`` and
        ``z_loss``; nothing is synchronised with the host until the caller reads them.
        """
        return [dict(layer.last_routing_stats) for layer in self.model.layers]

    def advance_router_schedule(self, n: int = 1) -> None:
        """Count ``n`` finished optimizer steps in every router: the SoftTopk ``t`` schedule
        advances and DeepSeek-V3 balancing biases move (``Router.advance_schedule``). The
        trainer calls it after every optimizer step; a loop of one's own calls it after
        ``optimizer.step()`` (or registers ``maxscore.routing.register_router_step_hook``)."""
        advance_routers(self, n)

    def parameter_counts(self) -> dict[str, int]:
        """Total and activated parameter counts (works on the meta device).

        Convention (matches the paper's table, see :mod:`maxscore.models.presets`): every
        parameter counts, including both the input embedding and the untied LM head and the router
        gates; "activated" counts a routed expert's parameters ``k / e`` times (a token uses ``k``
        of the ``e`` routed experts), shared experts and everything else fully.
        """
        total = sum(p.numel() for p in self.parameters())
        inactive = 0
        k, e = self.config.num_experts_per_tok, self.config.num_experts
        for layer in self.model.layers:
            if layer.is_moe:
                routed = sum(p.numel() for p in _routed_expert_parameters(layer.mlp, e))
                inactive += routed - routed * k // e
        return {"total": total, "activated": total - inactive}


def _routed_expert_parameters(moe: nn.Module, num_experts: int) -> list[nn.Parameter]:
    """The stacked routed-expert weights of an MoE layer: parameters with a leading ``e`` axis and
    at least 3 dims (``[e, D, F]``), which excludes the ``[e, D]`` gate and shared experts."""
    return [p for p in moe.parameters() if p.dim() >= 3 and p.shape[0] == num_experts]


# `save_pretrained` copies this file and the configuration file into the checkpoint and writes
# `auto_map`, so the checkpoint loads with `trust_remote_code=True` without importing maxscore first.
LlamaMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
LlamaMoEModel.register_for_auto_class("AutoModel")

__all__ = [
    "ATTENTION_IMPLEMENTATIONS",
    "LlamaMoECausalLMOutputWithPast",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "LlamaMoEModelOutputWithPast",
    "LlamaMoEPreTrainedModel",
]
