"""Naive per-token Python-loop references for the assignment strategies (tests only).

Written independently of :mod:`maxscore.routing.strategies` from the rules stated in its
docstrings, one group at a time on plain lists, so the vectorised code can be compared exactly.
Tie-breaking rules (the same as the library's): within a token the lower expert index wins;
across tokens the lower (choice rank, token position) wins.
"""

from __future__ import annotations

import torch
from torch import Tensor

Row = list[float]


def _ranked(row: Row, allowed: list[bool] | None = None) -> list[int]:
    """Expert indices by descending score, lower index first on ties; allowed ones first."""
    experts = list(range(len(row)))
    if allowed is None:
        return sorted(experts, key=lambda j: (-row[j], j))
    return sorted(experts, key=lambda j: (not allowed[j], -row[j], j))


def _to_lists(scores: Tensor) -> list[list[Row]]:
    return scores.double().tolist()


def _topk_one_group(a: list[Row], k: int, cap: list[int], drop_policy: str) -> list[list[int]]:
    n = len(a)
    choice = [_ranked(a[i])[:k] for i in range(n)]
    out = [[-1] * k for _ in range(n)]
    # Slots (rank, position) in the order they compete for capacity.
    slots = [(r, i) for r in range(k) for i in range(n)]
    if drop_policy == "score":
        slots.sort(key=lambda ri: (-a[ri[1]][choice[ri[1]][ri[0]]], ri[0], ri[1]))
    load = [0] * len(cap)
    for r, i in slots:
        j = choice[i][r]
        if load[j] < cap[j]:
            load[j] += 1
            out[i][r] = j
    return out


def reference_topk(scores: Tensor, k: int, capacity: Tensor, drop_policy: str) -> Tensor:
    cap = capacity.tolist()
    res = [_topk_one_group(a, k, cap, drop_policy) for a in _to_lists(scores)]
    return torch.tensor(res, dtype=torch.long).reshape(scores.shape[0], scores.shape[1], k)


def reference_topk_reroute(scores: Tensor, k: int, capacity: Tensor, drop_policy: str) -> Tensor:
    cap = capacity.tolist()
    e = scores.shape[-1]
    res = []
    for a in _to_lists(scores):
        out = _topk_one_group(a, k, cap, drop_policy)
        n = len(a)
        for _ in range(e):
            load = [0] * e
            for i in range(n):
                for j in out[i]:
                    if j >= 0:
                        load[j] += 1
            spare = [cap[j] - load[j] for j in range(e)]
            # Each token's dropped slots propose its best experts it lacks that have spare room.
            proposals: list[tuple[int, int, int]] = []  # (rank, token, expert)
            for i in range(n):
                cands = [j for j in _ranked(a[i]) if j not in out[i] and spare[j] > 0]
                d = 0
                for r in range(k):
                    if out[i][r] < 0:
                        if d < len(cands):
                            proposals.append((r, i, cands[d]))
                        d += 1
            proposals.sort(key=lambda p: (-a[p[1]][p[2]], p[0], p[1]))
            for r, i, j in proposals:
                if spare[j] > 0:
                    spare[j] -= 1
                    out[i][r] = j
        res.append(out)
    return torch.tensor(res, dtype=torch.long).reshape(scores.shape[0], scores.shape[1], k)


def reference_expert_choice(scores: Tensor, capacity: Tensor) -> Tensor:
    cap = capacity.tolist()
    g, n, e = scores.shape
    res = []
    for a in _to_lists(scores):
        out = [[-1] * e for _ in range(n)]
        for j in range(e):
            tokens = sorted(range(n), key=lambda i, j=j: (-a[i][j], i))
            for i in tokens[: max(cap[j], 0)]:
                out[i][j] = j
        res.append(out)
    return torch.tensor(res, dtype=torch.long).reshape(g, n, e)


def reference_dropless(scores: Tensor, k: int) -> Tensor:
    res = [[_ranked(row)[:k] for row in a] for a in _to_lists(scores)]
    return torch.tensor(res, dtype=torch.long).reshape(scores.shape[0], scores.shape[1], k)


def reference_group_limited(scores: Tensor, k: int, num_groups: int, topk_groups: int) -> Tensor:
    e = scores.shape[-1]
    size = e // num_groups
    res = []
    for a in _to_lists(scores):
        out = []
        for row in a:
            gscore = [max(row[g * size : (g + 1) * size]) for g in range(num_groups)]
            kept = sorted(range(num_groups), key=lambda g: (-gscore[g], g))[:topk_groups]
            allowed = [j // size in kept for j in range(e)]
            out.append(_ranked(row, allowed)[:k])
        res.append(out)
    return torch.tensor(res, dtype=torch.long).reshape(scores.shape[0], scores.shape[1], k)
