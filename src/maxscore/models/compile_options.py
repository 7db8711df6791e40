"""Inductor options for compiling the decoder layers around a known inductor code-generation bug.

Inductor (torch 2.11 and 2.13 here) fuses a row reduction and a column reduction of one
``[rows, cols]`` tensor into one "mix-order reduction" kernel (``torch._inductor.config.triton.
mix_order_reduction``; ``scheduler.MixOrderReduction.can_fuse``) once ``rows * cols`` reaches
``5 * 2**20`` elements, ``rows >= 2 * cols`` and ``rows >= 4096``. The router's ``[tokens, e]``
probabilities meet that at large micro-batches with many experts: the GShard load-balancing
loss reduces them per token (the top-1 argmax) and per expert (the mean probability and the
top-1 counts). For that kernel inductor (torch 2.11) emits the argmax's result used after the
loop that defines it, and Triton refuses the kernel (``NameError: tmp7 is not defined``), so the
first training step fails. Measured on an H200: base-8x128 with GShard compiles at micro-batch
64 x 512 (32,768 x 128 = 4.2M elements) and fails at 86 x 512 (5.6M). Below the threshold
inductor never builds such a kernel, so layers whose router tensor stays below it keep the
fusion (it also serves the RMSNorms' backward, where it saves a pass over the activations).
"""

from __future__ import annotations

from typing import Any

#: Elements of a ``[rows, cols]`` tensor from which inductor builds mix-order reductions
#: (``size_thres`` in ``torch._inductor.scheduler.MixOrderReduction.can_fuse``).
MIX_ORDER_REDUCTION_MIN_ELEMENTS = 5 * 2**20


def router_allows_mix_order_reduction(tokens_per_call: int, num_experts: int) -> bool:
    """Whether the router's ``[tokens_per_call, num_experts]`` tensor stays below the size at
    which inductor fuses its per-token and per-expert reductions (see the module docstring).

    ``tokens_per_call`` is the tokens one MoE layer routes at once on one process (micro-batch x
    sequence length); dense models (``num_experts == 0``) have no router tensor.
    """
    return tokens_per_call * num_experts < MIX_ORDER_REDUCTION_MIN_ELEMENTS


def without_mix_order_reduction(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compile_kwargs`` for ``torch.compile`` with inductor's mix-order reductions turned off.

    ``torch.compile`` takes a ``mode`` or ``options``, not both, so the mode becomes its own
    options (``torch._inductor.list_mode_options``) plus the switch. On a torch without the
    switch (an older one, which never builds such kernels) the arguments are returned unchanged.
    """
    import torch._inductor
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "mix_order_reduction"):
        return dict(compile_kwargs)
    kwargs = dict(compile_kwargs)
    mode = kwargs.pop("mode", None)
    options = dict(torch._inductor.list_mode_options(mode or "default"))
    options.update(kwargs.pop("options", None) or {})
    options["triton.mix_order_reduction"] = False
    kwargs["options"] = options
    return kwargs
