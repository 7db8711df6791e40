"""Llama-MoE causal language model: Llama blocks whose MLPs are :class:`maxscore.moe.MoE` layers.

Architecture (the paper's model): token embedding, ``num_hidden_layers`` pre-norm decoder blocks
(RMSNorm → grouped-query self-attention with RoPE → residual; RMSNorm → MoE or dense SwiGLU
MLP → residual), a final RMSNorm and an untied LM head.

Behaviour worth knowing:

* **Loss.** With ``labels``, ``loss`` = shifted next-token cross-entropy (``-100``, positions
  where ``attention_mask == 0`` and targets predicted from such a position are ignored) plus,
  *in training mode*, the sum over MoE layers of the router's load-balancing loss and z-loss. Those router losses are already multiplied by their
  coefficients inside the router (``config.router_aux_loss_coef`` is the router's
  ``aux_loss_coef``), so the stock HF ``Trainer`` optimises the paper's objective. In ``eval()``
  mode ``loss`` is the LM loss alone so that evaluation loss / perplexity is not polluted by a
  regulariser; the ``aux_loss`` / ``z_loss`` / ``lm_loss`` fields are always filled.
* **Fused loss (opt-in, training only).** :meth:`LlamaMoEForCausalLM.use_fused_linear_cross_entropy`
  makes training-mode forwards with ``labels`` compute the LM head and the same cross-entropy
  in one chunked kernel (liger-kernel, :func:`fused_linear_cross_entropy`) and return
  ``logits=None`` (as liger's patched HF models do): the ``[tokens, vocab]`` logits are never
  materialised. The switch is an attribute of the model object, not of its config, so
  ``config.json`` and saved checkpoints are the same with or without it.
* **Causal evaluation.** Routers follow ``config.eval_routing``: in ``eval()`` mode the
  default ``"causal"`` routing never lets a token's experts depend on later tokens, so logits at
  position t do not depend on tokens after t; ``"train"`` evaluates with the training routing.
* **Padding.** Positions where a 2-D ``attention_mask`` is 0 are masked out of attention and the
  LM loss, and the mask reaches every router: padding gets no expert, takes no capacity or flow
  slot, and counts in no router loss or statistic, so the real tokens' logits, losses and
  routing do not depend on what the padding holds (in training and evaluation mode, for every
  router preset; ``tests/test_padding.py``).
* **Attention backends.** Attention runs through transformers' attention interface
  (``ALL_ATTENTION_FUNCTIONS``): ``attn_implementation="sdpa"`` (default), ``"eager"`` (the
  explicit fp32 softmax, which also returns the weights for ``output_attentions=True``),
  ``"flash_attention_2"`` / ``"flash_attention_3"`` and ``"flex_attention"`` where installed,
  with the masks transformers builds for each. RoPE comes from transformers' RoPE functions
  (plain, ``llama3``, ``yarn``, ``dynamic``, ``linear``, ``longrope``; ``config.rope_parameters``).
* **Architecture variants** (for models converted from other families,
  :mod:`maxscore.models.convert`): q/k/v and output biases, QK-norm per head or over the full
  width, q/k/v clamping, a sliding attention window (in every layer or in the layers
  ``layer_types`` names), gated shared experts, dense layers at given indices. All off by
  default (Llama).
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

from maxscore.models.compile_options import without_mix_order_reduction
from maxscore.models.layers import (
    LlamaMoEAttention,
    LlamaMoERMSNorm,
    LlamaMoERotaryEmbedding,
)
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


#: The mask builder of each attention kind of ``config.layer_types``.
_MASK_BUILDERS = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}


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


class LlamaMoEDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: ``x + Attn(Norm(x))`` then ``x + MLP(Norm(x))`` with an MoE or dense MLP.

    ``forward`` returns a tuple of tensors ``(hidden, router_logits, aux_loss, z_loss,
    attention_weights)`` (the router entries ``None`` for a dense layer, the weights ``None``
    unless the eager kernel computed them) instead of a :class:`RoutingResult`, so gradient
    checkpointing (re-entrant or not) carries the router losses' gradients. The layer's detached routing
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
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        del use_cache  # accepted so GradientCheckpointingLayer can switch it off; the cache decides
        attended, weights = self.self_attn(
            self.input_layernorm(hidden_states),
            cos,
            sin,
            attention_mask,
            past_key_values,
            position_ids,
        )
        h = hidden_states + attended
        normed = self.post_attention_layernorm(h)
        if not self.is_moe:
            return h + self.mlp(normed), None, None, None, weights
        y, routing = self.mlp(normed, token_mask)
        # Detached device tensors only: reading them later is the caller's (single) host sync.
        # The routing statistics are lazy (evaluated when routing_statistics() reads them).
        self.last_routing_stats = with_extra_statistics(
            routing.stats, aux_loss=routing.aux_loss.detach(), z_loss=routing.z_loss.detach()
        )
        # A batch padded to whole routing groups (MoE._pad_to_whole_groups) routed extra rows.
        logits = routing.logits[: y.shape[0] * y.shape[1]]
        return h + y.to(h.dtype), logits, routing.aux_loss, routing.z_loss, weights


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
    # Attention goes through transformers' interface (LlamaMoEAttention), so every kernel works.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
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
        self.rotary_emb = LlamaMoERotaryEmbedding(config)
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
        output_attentions: bool | None = None,
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
            output_attentions: return every layer's attention weights ``[B, H, L, S]``; needs
                ``attn_implementation="eager"`` (the other kernels never form the weights).
        """
        if past_key_values is None:
            past_key_values = kwargs.pop("cache", None)  # newer transformers' name for it
        del kwargs  # HF passes extras (e.g. return_dict handled by the caller); none are used
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if output_attentions and self.config._attn_implementation != "eager":
            raise ValueError(
                "output_attentions=True needs the eager attention kernel (attn_implementation="
                f"{self.config._attn_implementation!r} never forms the attention weights); load "
                "the model with attn_implementation='eager' or call "
                "model.set_attn_implementation('eager')"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache is None:
            # A cache is only useful for generation; don't build one in every training step.
            use_cache = self.config.use_cache and not self.training
        # An empty cache made here changes no mask, but transformers' mask builder only reads
        # packed sequences (position_ids restarting at 0, instruction blocks) without a cache,
        # so the builder sees the caller's cache only.
        mask_cache = past_key_values
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

        # transformers' mask builders, in the format of the attention kernel (None when SDPA's
        # is_causal is exact; a 4D mask with padding + causal aligned to the cache, additive
        # for eager; 2D for flash-attention; a BlockMask for flex), one per attention kind
        # the layers use (full / sliding window).
        mask_arguments = {
            "config": self.config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "position_ids": given_position_ids,
            _MASK_CACHE_ARGUMENT: mask_cache,
        }
        kinds = {self.config.layer_attention(i) for i in range(len(self.layers))}
        masks = {kind: _MASK_BUILDERS[kind](**mask_arguments) for kind in kinds}
        cos, sin = self.rotary_emb(position_ids, inputs_embeds.dtype)

        # The routers see which positions are padding (a 2-D mask only; a prepared 4-D mask
        # carries no per-token flag).
        token_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            token_mask = attention_mask[:, -length:].bool()

        hidden = inputs_embeds
        all_hidden: list[Tensor] = []
        router_logits: list[Tensor] = []
        attentions: list[Tensor | None] = []
        aux_total: Tensor | None = None
        z_total: Tensor | None = None
        for i, layer in enumerate(self.layers):
            if output_hidden_states:
                all_hidden.append(hidden)
            hidden, logits, aux, z, weights = layer(
                hidden,
                cos,
                sin,
                attention_mask=masks[self.config.layer_attention(i)],
                past_key_values=past_key_values,
                use_cache=use_cache,
                token_mask=token_mask,
                position_ids=position_ids,
            )
            attentions.append(weights)
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
            attentions=tuple(attentions) if output_attentions else None,
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
        # A runtime switch (use_fused_linear_cross_entropy), not a config field: a checkpoint
        # must load and run the same in plain transformers, without liger-kernel.
        self.fused_linear_cross_entropy = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def use_fused_linear_cross_entropy(self, enabled: bool = True) -> None:
        """Compute the training loss with the fused LM head + cross-entropy (or stop doing so).

        When on, a forward in training mode with ``labels`` passes the final hidden states and
        ``lm_head.weight`` to :func:`fused_linear_cross_entropy` (liger-kernel: the logits are
        made and consumed chunk by chunk, with fp32 log-sum-exp and an fp32 weight-gradient
        accumulator) and returns ``logits=None``. The loss is defined as the unfused one:
        shifted by one, ``-100`` and padding ignored, the mean over the remaining targets.
        Evaluation-mode forwards and forwards without labels compute logits as always. Needs a
        CUDA GPU and liger-kernel (Triton kernels); nothing is checked here, the training run
        checks both before it starts (:mod:`maxscore.training.fused_loss`).
        """
        self.fused_linear_cross_entropy = enabled

    def compile_layers(self, *, mix_order_reduction: bool = True, **compile_kwargs: Any) -> None:
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

        ``mix_order_reduction=False`` turns off inductor's fused row-and-column reductions, which
        fail to compile for a large router tensor (:mod:`maxscore.models.compile_options`).
        """
        compile_kwargs.setdefault("dynamic", False)
        if not mix_order_reduction:
            compile_kwargs = without_mix_order_reduction(compile_kwargs)
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
        output_attentions: bool | None = None,
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
            output_attentions=output_attentions,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = hidden[:, keep, :]
        fused = self.fused_linear_cross_entropy and self.training and labels is not None
        logits = None if fused else self.lm_head(hidden)

        loss = lm_loss = None
        if labels is not None:
            if attention_mask is not None and attention_mask.dim() == 2:
                pad = attention_mask[:, -labels.shape[1] :] == 0
                # A target counts only if it and the position predicting it are real tokens:
                # after left padding the first real token would be predicted from a pad.
                predicted_from_pad = F.pad(pad[:, :-1], (1, 0), value=False)
                labels = labels.masked_fill(pad | predicted_from_pad, -100)
            if fused:
                lm_loss = fused_linear_cross_entropy(hidden, self.lm_head.weight, labels)
            else:
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
            attentions=outputs.attentions,
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


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """Next-token cross-entropy of ``hidden @ weight.T`` without materialising the logits.

    ``hidden`` is ``[B, L, D]``, ``labels`` ``[B, L]`` aligned with the inputs: position ``t``
    is scored against ``labels[:, t + 1]`` and the last position against nothing, as in
    transformers' ``ForCausalLMLoss``; ``-100`` is ignored and the loss is the mean over the
    other targets. liger-kernel's fused linear cross-entropy computes it chunk by chunk in
    Triton, with fp32 log-sum-exp and an fp32 accumulator for the weight gradient; under bf16
    autocast its matmuls run in bf16 as the unfused ``lm_head`` does. A CUDA GPU is needed.
    """
    # Imported here: liger-kernel is an optional dependency (maxscore[speed]) that pulls in
    # Triton. In a try block because transformers' remote-code loader demands every import it
    # finds in this file (copied into checkpoints) except those inside try/except.
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError as err:
        raise ImportError(
            "the fused LM loss needs liger-kernel: pip install 'maxscore[speed]'"
        ) from err

    targets = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        ignore_index=-100,
        reduction="mean",
        accum_dtype=torch.float32,
    )


def _routed_expert_parameters(moe: nn.Module, num_experts: int) -> list[nn.Parameter]:
    """The stacked routed-expert weights of an MoE layer: parameters with a leading ``e`` axis and
    at least 3 dims (``[e, D, F]``), which excludes the ``[e, D]`` gate and shared experts."""
    return [p for p in moe.parameters() if p.dim() >= 3 and p.shape[0] == num_experts]


# `save_pretrained` copies this file and the configuration file into the checkpoint and writes
# `auto_map`, so the checkpoint loads with `trust_remote_code=True` without importing maxscore first.
LlamaMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")
LlamaMoEModel.register_for_auto_class("AutoModel")

__all__ = [
    "LlamaMoECausalLMOutputWithPast",
    "LlamaMoEForCausalLM",
    "LlamaMoEModel",
    "LlamaMoEModelOutputWithPast",
    "LlamaMoEPreTrainedModel",
]
