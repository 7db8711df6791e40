"""Routing groups and expert capacity.

Capacity is defined per *routing group*: one sequence, a fixed number of tokens, or the
whole micro-batch. The authors' code used one 512-token sequence for MaxScore and the micro-batch
for the baselines. Groups are contiguous runs of tokens in the input's flattened ``[B*L]`` order,
so tokens ``g*n .. (g+1)*n - 1`` form group ``g`` and flattening the groups restores the input
order.
"""

from __future__ import annotations

from fractions import Fraction

from torch import Tensor

from maxscore.routing.config import RouterConfig

__all__ = ["expert_capacity", "group_size_for", "split_into_groups"]


def group_size_for(batch_size: int, seq_len: int, config: RouterConfig) -> int:
    """Tokens per routing group ``n`` for a ``[batch_size, seq_len]`` input (python ints)."""
    total = batch_size * seq_len
    if config.group == "sequence":
        n = seq_len
    elif config.group == "batch":
        n = total
    else:
        n = int(config.group_size or 0)
    if n < 1 or total % n != 0:
        raise ValueError(
            f"cannot split {batch_size} x {seq_len} = {total} tokens into routing groups of "
            f"{n} tokens (group={config.group!r}); the token count must be a multiple of the "
            "group size"
        )
    return n


def split_into_groups(x: Tensor, config: RouterConfig) -> Tensor:
    """``x[B, L, ...] -> [G, n, ...]`` routing groups (a view when possible; pads nothing).

    Raises ValueError if ``B*L`` is not a multiple of the group size.
    """
    if x.dim() < 2:
        raise ValueError(f"split_into_groups needs x of shape [B, L, ...], got {tuple(x.shape)}")
    batch, seq = x.shape[0], x.shape[1]
    n = group_size_for(batch, seq, config)
    return x.reshape(batch * seq // n, n, *x.shape[2:])


def expert_capacity(
    n: int, e: int, k: int, capacity_factor: float = 1.0, min_capacity: int = 1
) -> int:
    """Tokens each expert may take in a group of ``n``: ``c = ceil(capacity_factor · k · n / e)``.

    GShard's ``c = k·n/e`` (Sec. 2.3) scaled by the capacity factor, at least ``min_capacity``
    and at most ``n`` (an expert can take a token once, so more room is never used).
    """
    if n < 1 or e < 1 or k < 1:
        raise ValueError(f"need n, e, k >= 1, got n={n}, e={e}, k={k}")
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    # Exact integer arithmetic on the factor as a fraction (1.2 -> 6/5), so 1.2 * 5 = 6 is not
    # rounded up to 7, and so that under torch.compile with a symbolic n (a shape-generic
    # graph) the capacity is the same integer: a float expression such as
    # ceil(round(f * k * n / e, 9)) traces to 1,921 instead of 1,920 for n = 15,360, and the
    # router's capacity then disagrees with the expert buffers (wrong routing, writes out of
    # bounds; benchmarks/compile/README.md).
    factor = Fraction(capacity_factor).limit_denominator(10**9)
    c = -(-(factor.numerator * k * n) // (factor.denominator * e))
    return min(max(c, min_capacity), n)
