"""The global solver of Eq. (7)–(8), reference implementation (NumPy, one routing group at a time).

Eq. (8) asks for the 0/1 matrix ``P`` (``n x e``) that maximises ``sum_ij P_ij A_ij`` subject to
Eq. (7): each token takes ``k`` distinct experts, expert ``j`` takes at most ``c_j`` tokens (the
paper's min-cost max-flow network: source -> token of capacity ``k``, token -> expert of capacity
1 and cost ``-A_ij``, expert -> sink of capacity ``c_j``). The solver has three phases:

1. **Auction** (a Jacobi forward auction, Bertsekas; tokens bid, experts are the objects, each
   with ``c_j`` slots). Every token missing ``m`` slots looks at the reduced values
   ``A_ij - p_j`` of the experts it does not hold, takes its best ``m`` and bids for each
   ``A_ij - w + eps``, ``w`` being its ``(m+1)``-th best reduced value; each expert keeps the
   ``c_j`` highest offers among its slots' prices and the new bids, and its price ``p_j`` is its
   cheapest slot's. A slot won this way is within ``eps`` of the token's best alternative
   (eps-complementary slackness), and a finished auction is within ``n k eps`` of the optimum.
   The prices start near the optimal duals of Eq. (8)'s LP (:func:`dual_prices`): from zero
   prices the auction would spend thousands of rounds raising the popular experts' prices by
   ``eps`` at a time (a router early in training gives every token nearly the same row). The
   auction stops after ``auction_rounds`` rounds, once at most ``stop_open`` of the slots are
   open, or once its last ``STALL_ROUNDS`` rounds filled fewer than ``STALL_FILL`` slots: its
   tail fills slowly, and phase 2 fills those slots in far fewer steps. A token evicted from
   one expert may then prefer it to a slot it still holds by more than ``eps`` (that slot was
   won against other prices); such slots are given up, so eps-complementary slackness holds
   for every held slot when phase 2 starts. With eps-scaling (``epsilon_scales``, Bertsekas;
   only where the prices do not start at the duals: with spare capacity, or without
   ``price_iterations``) earlier auctions bid those many times the eps and settle the contested
   prices in large steps; each next auction starts again from the previous one's prices.
2. **Augmenting paths** on the *expert graph*: ``e + 2`` nodes (the experts, a node ``S`` for
   spare capacity and a node ``D`` for open slots). Edge ``a -> b`` carries the best move
   "a token on ``a`` that is not on ``b`` leaves ``a`` for ``b``", of gain ``A_tb - A_ta``;
   ``D -> b`` the best token with an open slot taking ``b`` (gain ``A_tb``). The best path from
   ``D`` to an expert with spare capacity fills an open slot through any chain of moves; each
   round applies every such path of the shortest-path tree that shares no node with a better one
   (so the moves of one round never conflict). This is successive shortest paths on the flow
   network with its token nodes contracted: it gives every token ``k`` experts whenever
   ``sum_j min(c_j, n) >= n k`` (a maximum flow otherwise), and keeps the assignment optimal
   for its loads. Here the paths come from Bellman-Ford with every edge charged ``tol + eps``
   (the auction leaves no cycle above that); the CUDA kernel finds the same paths with
   Dijkstra or a frontier search on reduced costs (``kernels/phase2_paths.cuh``). Where the
   capacities exceed the demand, phase 2 then goes on from ``S`` (:func:`_to_sink`): a free slot
   must end at the lowest price, which eps-scaling's restarts do not leave, and each path of
   positive gain from ``S`` to an expert with a free slot is a positive cycle through ``S``; a
   round applies every node-disjoint one of its tree (phase 3 would find them one a round).
3. **Cycle cancelling** on the same graph, now also with ``b -> S`` (``b`` has spare capacity),
   ``S -> a`` (any expert may lose a token) and ``a -> D`` (a token gives up its slot at ``a``
   when the flow is not full, gain ``-A_ta``): a feasible assignment is optimal iff this graph
   has no cycle of positive gain (the residual graph of the flow network with the token nodes
   contracted). Each round finds, by Bellman-Ford from a virtual source joined to every node,
   the cycles of its predecessor graph (they are node-disjoint, so their moves are compatible)
   and applies them, at most ``cancel_rounds`` rounds. Phases 1-2 leave little for it; capacity
   short of ``n k`` needs it. Every edge is charged ``tol`` (a relative 1e-6 of the affinities'
   spread, about 16 float32 rounding steps) so rounding cannot create a cycle.

The CUDA kernels (:mod:`.global_cuda`, ``kernels/``) run the same three phases on the GPU. This
module computes on the host in float64, one group after another; it is the solver's CPU path
and its reference in the tests. Measured gaps and times: ``benchmarks/flow_solver/README.md``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["GlobalBudget", "solve_group", "solve_reference"]


#: Auctions before the last one that the CUDA kernel can run (its EPS_SCALE, EPS_SCALE2).
MAX_EPSILON_SCALES = 2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GlobalBudget:
    """Step counts and tolerances of the global solver (shared by every backend).

    Attributes:
        auction_rounds: Jacobi auction rounds (phase 1) at most, in each of its auctions.
        stop_open: phase 1 also stops once at most this fraction of the ``n k`` slots (at least
            one) is open: its last slots fill slowly (bidders raise prices by ``epsilon`` at a
            time), phase 2 fills them with far fewer rounds.
        epsilon: the auction's bid increment, relative to the mean of each token's top-``k``
            affinities (so a finished auction is within about ``epsilon`` of the optimum,
            relative; phases 2-3 then remove what is left).
        epsilon_scales: eps-scaling: the auctions before the last, in order, each bidding that
            many times ``epsilon`` and each starting again from the previous one's prices; the
            last bids ``epsilon``. At most two integers (compile-time constants of the CUDA
            kernel), each above 1, decreasing; ``()``: one auction. Only where the auction does
            not start from the dual prices (:func:`uses_dual_prices`): with spare capacity, or
            without ``price_iterations``.
        epsilon_scale_max_tokens: eps-scaling only in groups of at most this many tokens
            (``None``: every group; 0: one auction everywhere). The kernel lists the overflowing
            bids by expert, so the later auctions' first rounds (every slot bids again) are
            cheap in large groups too.
        price_iterations: iterations of :func:`dual_prices`, the auction's starting prices
            where the capacities do not exceed the demand (0: the experts' mean affinities).
            Each is one Newton step for every token's and then every expert's dual variable.
        price_temperatures: (first, last) temperature of :func:`dual_prices`, relative like
            ``epsilon``; the iterations lower it geometrically from the first to the last.
        sink_rounds: rounds of paths through the sink (phase 2's last part, with spare capacity
            only) at most (``None``: ``n k``, phase 2's own bound); each round applies every
            node-disjoint positive path of its tree, so paths into one expert take a round each
            (where every token prefers one expert, as many rounds as that expert has slots to
            give up: a smaller bound can stop far from the optimum).
        cancel_rounds: cycle-cancelling rounds (phase 3) at most. Phases 1-2 leave it few
            rounds, with spare capacity too (the paths from ``S``). A round moves one token
            through each expert at most.
        relaxations: Bellman-Ford relaxations per cycle-cancelling round (phase 3) and per first
            try of a phase-2 round. Positive cycles are short, so their predecessor cycles show up
            within a few relaxations; a phase-2 round that finds no path this way searches fully
            (``e + 3``), so the flow is always maximum.
        tolerance: gain charged to every expert-graph edge, relative to the affinities' spread
            (about 16 float32 rounding steps of the largest affinity, so that rounding never
            makes a cycle look positive).
    """

    auction_rounds: int = 96
    stop_open: float = 0.005
    epsilon: float = 1e-5
    epsilon_scales: tuple[int, ...] = (400, 30)
    epsilon_scale_max_tokens: int | None = None
    price_iterations: int = 30
    price_temperatures: tuple[float, float] = (0.3, 3e-5)
    sink_rounds: int | None = None
    cancel_rounds: int = 256
    relaxations: int = 12
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        if self.sink_rounds is not None and (not _is_int(self.sink_rounds) or self.sink_rounds < 0):
            raise ValueError(
                "GlobalBudget.sink_rounds must be None (n k: phase 2's own bound) or an integer "
                f">= 0, got {self.sink_rounds!r}"
            )
        scales = self.epsilon_scales
        if (
            not isinstance(scales, tuple)
            or len(scales) > MAX_EPSILON_SCALES
            or not all(_is_int(x) and x > 1 for x in scales)
            or any(a <= b for a, b in itertools.pairwise(scales))
        ):
            raise ValueError(
                f"GlobalBudget.epsilon_scales must be a tuple of at most {MAX_EPSILON_SCALES} "
                f"decreasing integers above 1 (() for one auction), got {scales!r}"
            )
        if not _is_int(self.price_iterations) or self.price_iterations < 0:
            raise ValueError(
                "GlobalBudget.price_iterations must be an integer >= 0 (0: the auction starts "
                f"from the experts' mean affinities), got {self.price_iterations!r}"
            )
        temps = self.price_temperatures
        if (
            not isinstance(temps, tuple)
            or len(temps) != 2
            or not all(isinstance(t, float | int) and math.isfinite(t) and t > 0 for t in temps)
            or temps[1] > temps[0]
        ):
            raise ValueError(
                "GlobalBudget.price_temperatures must be (first, last): two positive numbers, "
                f"the first not below the last, got {temps!r}"
            )
        limit = self.epsilon_scale_max_tokens
        if limit is not None and (not _is_int(limit) or limit < 0):
            raise ValueError(
                "GlobalBudget.epsilon_scale_max_tokens must be None (every group size) or an "
                f"integer >= 0 (0: one auction at every group size), got {limit!r}"
            )

    def sink_rounds_for(self, n: int, k: int) -> int:
        """Rounds of paths through the sink at most in a group of ``n`` tokens."""
        return n * k if self.sink_rounds is None else self.sink_rounds

    def epsilon_scales_for(self, n: int) -> tuple[int, ...]:
        """The eps-scaling auctions of a group of ``n`` tokens (``()``: one auction)."""
        limit = self.epsilon_scale_max_tokens
        return self.epsilon_scales if limit is None or n <= limit else ()


def solve_reference(
    affinities: np.ndarray,
    k: int,
    capacity: np.ndarray,
    budget: GlobalBudget | None = None,
    token_mask: np.ndarray | None = None,
) -> np.ndarray:
    """Solve Eq. (8) for each group of ``affinities[G, n, e]``; ``capacity`` is ``[e]`` or
    ``[G, e]``; ``token_mask[G, n]`` (False: a padded position, which takes no expert and does
    not influence the others). Returns the ``[G, n, e]`` bool assignment ``P``."""
    a = np.asarray(affinities, dtype=np.float64)
    groups, n, e = a.shape
    cap = np.broadcast_to(np.asarray(capacity, dtype=np.int64), (groups, e))
    real = np.ones((groups, n), dtype=bool) if token_mask is None else np.asarray(token_mask, bool)
    budget = budget or GlobalBudget()
    out = np.zeros((groups, n, e), dtype=bool)
    for g in range(groups):
        rows = np.flatnonzero(real[g])
        out[g, rows] = solve_group(a[g, rows], k, cap[g], budget)
    return out


def solve_group(
    a: np.ndarray,
    k: int,
    capacity: np.ndarray,
    budget: GlobalBudget,
    stats: dict[str, int] | None = None,
) -> np.ndarray:
    """One group: ``a[n, e]`` float64, ``capacity[e]`` ints; the ``[n, e]`` bool ``P``.

    ``stats``, if given, receives the work done: ``auction_rounds`` (of all its auctions),
    ``open_after_auction`` (slots phase 1 left open), ``augment_rounds``, ``paths``,
    ``sink_rounds``, ``sink_paths``, ``cancel_rounds``.
    """
    stats = {} if stats is None else stats
    n, e = a.shape
    cap = np.minimum(np.asarray(capacity, dtype=np.int64), n)
    if n == 0 or e == 0:
        return np.zeros((n, e), dtype=bool)
    held, _, rounds = _auction(a, k, cap, budget)
    stats.update(
        auction_rounds=rounds,
        open_after_auction=int(k * n - held.sum()),
        augment_rounds=0,
        paths=0,
        sink_rounds=0,
        sink_paths=0,
        cancel_rounds=0,
    )
    spread = float(a.max() - a.min()) or 1.0
    tol = budget.tolerance * spread
    # Phase 2's edges are charged the auction's eps too: its state has no cycle above that.
    charge = tol + auction_epsilon(a, budget)
    # Phase 2: fill open slots along augmenting paths (each round fills at least one while a
    # path exists, so at most n k rounds).
    while (held.sum(1) < k).any():
        graph = _expert_graph(a, held, cap, k, cycles=False)
        moved = _augment(graph, held, cap, charge, budget.relaxations)
        stats["augment_rounds"] += 1
        stats["paths"] += moved
        if not moved:  # no path left: the flow is maximum
            break
    # Then, with spare capacity, tokens move towards free slots along positive paths from S.
    if int(cap.sum()) > n * k:
        for _ in range(budget.sink_rounds_for(n, k)):
            moved = _to_sink(_expert_graph(a, held, cap, k, cycles=False), held, charge)
            if not moved:
                break
            stats["sink_rounds"] += 1
            stats["sink_paths"] += moved
    # Phase 3: cancel positive cycles until none is left or the budget is spent.
    for _ in range(budget.cancel_rounds):
        if not _cancel(_expert_graph(a, held, cap, k, cycles=True), held, tol, budget.relaxations):
            break
        stats["cancel_rounds"] += 1
    return held


# --- phase 1 ---------------------------------------------------------------------------------


def auction_epsilon(a: np.ndarray, budget: GlobalBudget) -> float:
    """The auction's bid increment: ``budget.epsilon`` times the mean of the rows' maxima."""
    spread = float(a.max() - a.min()) or 1.0
    return max(budget.epsilon * float(a.max(axis=1).mean()), 1e-12 * spread)


# The auction stops once STALL_ROUNDS rounds filled fewer than STALL_FILL slots: its tail, where
# bidders raise prices by eps at a time (a round of phase 2 costs as much as several).
STALL_ROUNDS = 8
STALL_FILL = 2
# A held slot is given up after the auction only when its token prefers another expert by more
# than eps and this many times the magnitudes of the values compared (four float32 units in the
# last place; the kernel's `release_slack`).
RELEASE_SLACK = 4 * float(np.finfo(np.float32).eps)


def stop_open_slots(n: int, k: int, budget: GlobalBudget) -> int:
    """Open slots at which the auction hands over to phase 2."""
    return max(1, int(budget.stop_open * n * k))


def warm_prices(a: np.ndarray) -> np.ndarray:
    """The auction's starting prices: each expert's mean affinity, the lowest shifted to 0."""
    mean = a.mean(axis=0)
    return mean - mean.min()


def price_temperature(budget: GlobalBudget, iteration: int) -> float:
    """:func:`dual_prices`' temperature at ``iteration`` (relative to the mean row maximum):
    geometric from ``price_temperatures[0]`` at the first iteration to ``[1]`` at the last."""
    first, last = budget.price_temperatures
    steps = max(1, budget.price_iterations - 1)
    return float(first * (last / first) ** (iteration / steps))


def dual_prices(a: np.ndarray, k: int, cap: np.ndarray, budget: GlobalBudget) -> np.ndarray:
    """Prices near the optimal dual of Eq. (8)'s linear program, by block coordinate ascent of
    its entropy-regularised dual.

    Eq. (8)'s LP (``0 <= P_ij <= 1``, rows summing to ``k``, column ``j`` to ``c_j``) has a dual
    variable ``u_i`` per token and a price ``p_j`` per expert; at the optimum token ``i`` takes
    the experts with ``A_ij - p_j > u_i``. With an entropy term of temperature ``T`` (entries
    in ``[0, 1]``: the Fermi-Dirac form) the plan is ``P_ij = sigmoid((A_ij - u_i - p_j) / T)``,
    and each iteration takes one Newton step on every ``u_i`` (row sum ``k``) and then on every
    ``p_j`` (column sum ``c_j``), each step clipped to ``2 T`` (the sums are steep where few
    entries are fractional). ``T`` falls geometrically (:func:`price_temperature`), so early
    iterations move the prices in large steps and late ones settle them within a few ``T`` of
    the optimal duals, where an auction has a few rounds left (the CUDA kernel computes the
    same iterations in float32). Starts from :func:`warm_prices` and each token's mean reduced
    affinity. Temperatures are relative to the mean row maximum (the spread, or 1, where that
    is not positive). Experts without capacity keep price 0 (the auction never offers them)."""
    n, e = a.shape
    live = cap > 0
    p = warm_prices(a)
    if budget.price_iterations == 0 or n == 0 or not live.any():
        return p
    scale = float(a.max(axis=1).mean())
    if not scale > 0:
        scale = float(a.max() - a.min()) or 1.0
    target = np.minimum(cap, n).astype(np.float64)
    al = a[:, live]
    pl, tl = p[live], target[live]
    u = (al - pl).mean(axis=1)

    def sigmoid(x: np.ndarray) -> np.ndarray:
        return 0.5 + 0.5 * np.tanh(0.5 * np.clip(x, -80.0, 80.0))

    def newton(x: np.ndarray, z: np.ndarray, goal: float | np.ndarray, t: float) -> np.ndarray:
        # One Newton step per row of z (z[r] - x[r] inside the sigmoid), sums towards goal.
        s = sigmoid((z - x[:, None]) / t)
        f = s.sum(axis=1) - goal
        d = (s * (1.0 - s)).sum(axis=1) / t
        return x + np.clip(f / np.maximum(d, 1e-30), -2.0 * t, 2.0 * t)

    for it in range(budget.price_iterations):
        t = price_temperature(budget, it) * scale
        u = newton(u, al - pl, float(k), t)
        pl = newton(pl, (al - u[:, None]).T, tl, t)
    p = np.zeros(e)
    p[live] = pl - pl.min()
    return p


def uses_dual_prices(n: int, k: int, cap: np.ndarray, budget: GlobalBudget) -> bool:
    """Whether the auction starts from :func:`dual_prices` (then as one auction, without
    eps-scaling: the prices are already settled): with ``price_iterations`` and capacities not
    above the demand ``n k``."""
    return budget.price_iterations > 0 and int(np.asarray(cap).sum()) <= n * k


def starting_prices(a: np.ndarray, k: int, cap: np.ndarray, budget: GlobalBudget) -> np.ndarray:
    """The first auction's prices: :func:`dual_prices` (:func:`uses_dual_prices`), or
    :func:`warm_prices` without its iterations, or 0 for every expert when the capacities exceed
    the demand ``n k``. Then the experts left with a free slot must end at the
    lowest price (complementary slackness of the edges to the sink); from warm prices they stay
    above it and keep tokens away, more than cycle cancelling undoes in its rounds."""
    if int(cap.sum()) > a.shape[0] * k:
        return np.zeros(a.shape[1])
    return dual_prices(a, k, cap, budget)


def _auction(
    a: np.ndarray, k: int, cap: np.ndarray, budget: GlobalBudget
) -> tuple[np.ndarray, np.ndarray, int]:
    """Phase 1: ``[n, e]`` bool holdings, the experts' final prices (their cheapest slots') and
    the rounds of all its auctions (eps-scaling's, then the last one's, whose eps is the
    smallest: its tail is shorter, so it leaves phase 2 fewer slots)."""
    closed = cap == 0  # an expert without capacity is never offered
    eps = auction_epsilon(a, budget)
    start = starting_prices(a, k, cap, budget)
    rounds = 0
    dual = uses_dual_prices(a.shape[0], k, cap, budget)
    for scale in [*(() if dual else budget.epsilon_scales_for(a.shape[0])), 1]:
        held, price, used = _auction_stage(a, k, cap, budget, start, eps * scale)
        rounds += used
        start = np.where(closed, 0.0, price - price[~closed].min()) if (~closed).any() else start
    # A token evicted from one expert can now prefer it to one it still holds by more than eps
    # (it was won against other prices): give such slots up, so that eps-complementary
    # slackness holds for every held slot and phase 2 starts without positive cycles. Beyond
    # float32 rounding of the values compared (the GPU kernel's arithmetic): a slot won by the
    # lowest bid is worth exactly the bid level minus eps, up to that rounding.
    reduced = a - price
    best_alt = np.where(held | closed, -np.inf, reduced).max(axis=1, keepdims=True)
    slack = RELEASE_SLACK * (np.abs(a) + np.abs(price) + np.abs(best_alt))
    held &= ~(reduced < best_alt - eps - slack)
    return held, price, rounds


def _auction_stage(
    a: np.ndarray, k: int, cap: np.ndarray, budget: GlobalBudget, start: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """One auction from the prices ``start``, every slot open, with bid increment ``eps``: at
    most ``budget.auction_rounds`` rounds; the holdings, the experts' prices and the rounds
    that bid.

    Each expert has ``c_j`` slots, each with a price (``start`` while nobody holds it, then the
    winning bid), so prices never fall.
    """
    n, e = a.shape
    closed = cap == 0
    # No alternative left (a token that needs every expert it does not hold): bid as if the
    # next best were this far below the worst affinity.
    floor = float(a.min() - (a.max() - a.min()) - 1.0)
    slot_price = [np.full(int(c), p) for c, p in zip(cap, start, strict=True)]
    slot_owner = [np.full(int(c), -1) for c in cap]
    held = np.zeros((n, e), dtype=bool)
    stop = stop_open_slots(n, k, budget)
    history: list[int] = []
    rounds = 0
    for round_ in range(budget.auction_rounds):
        missing = k - held.sum(axis=1)
        open_now = int(missing.sum())
        if open_now <= (0 if round_ == 0 else stop):
            break
        # ... or when the last STALL_ROUNDS rounds filled fewer than STALL_FILL slots
        if round_ >= STALL_ROUNDS and history[-STALL_ROUNDS] - open_now < STALL_FILL:
            break
        history.append(open_now)
        rounds += 1
        price = np.array([sp.min() if sp.size else np.inf for sp in slot_price])
        bids = _bids(a, held, closed, price, missing, k, floor, eps)
        for j, (tokens, values) in bids.items():
            # The c_j highest offers among the slots' prices and the new bids stay.
            prices = np.concatenate([slot_price[j], values])
            owners = np.concatenate([slot_owner[j], tokens])
            keep = np.argsort(-prices, kind="stable")[: cap[j]]
            for t in slot_owner[j][slot_owner[j] >= 0]:
                if t not in owners[keep]:
                    held[t, j] = False
            slot_price[j], slot_owner[j] = prices[keep], owners[keep]
            for t in slot_owner[j][slot_owner[j] >= 0]:
                held[t, j] = True
    price = np.array([sp.min() if sp.size else np.inf for sp in slot_price])
    return held, price, rounds


def _bids(
    a: np.ndarray,
    held: np.ndarray,
    closed: np.ndarray,
    price: np.ndarray,
    missing: np.ndarray,
    k: int,
    floor: float,
    eps: float,
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Every token missing ``m`` slots bids for its best ``m`` experts: ``{expert: (tokens,
    bids)}``, a bid being ``A_ij - w + eps`` with ``w`` the token's ``(m+1)``-th best reduced
    value (so the token stays within ``eps`` of its next best choice at the new price)."""
    bidders = np.flatnonzero(missing > 0)
    reduced = np.where(held[bidders] | closed, -np.inf, a[bidders] - price)
    order = np.argsort(-reduced, axis=1, kind="stable")[:, : k + 1]
    values = np.take_along_axis(reduced, order, axis=1)
    if values.shape[1] < k + 1:  # fewer than k + 1 experts
        values = np.concatenate(
            [values, np.full((len(bidders), k + 1 - values.shape[1]), -np.inf)], axis=1
        )
    m = missing[bidders]
    w = values[np.arange(len(bidders)), np.minimum(m, k)]
    w = np.where(np.isfinite(w), w, floor)
    out: dict[int, list[tuple[int, float]]] = {}
    for r in range(min(k, order.shape[1])):
        for row in np.flatnonzero((r < m) & np.isfinite(values[:, r])):
            t, j = int(bidders[row]), int(order[row, r])
            out.setdefault(j, []).append((t, a[t, j] - w[row] + eps))
    return {
        j: (np.array([t for t, _ in v]), np.array([b for _, b in v]))
        for j, v in sorted(out.items())
    }


# --- the expert graph ------------------------------------------------------------------------


@dataclass
class _Graph:
    """Edges of the expert graph: ``gain[u, v]`` and the token that realises each edge."""

    gain: np.ndarray  # [V, V], V = e + 2; -inf = no edge
    token: np.ndarray  # [V, V] int, -1 where no token is involved
    spare: np.ndarray  # [e] bool, expert has spare capacity
    open_slots: np.ndarray  # [n] int, slots each token still has open


def _expert_graph(
    a: np.ndarray, held: np.ndarray, cap: np.ndarray, k: int, *, cycles: bool
) -> _Graph:
    """Build the expert graph of ``held`` (nodes: experts ``0..e-1``, ``S = e``, ``D = e + 1``).

    ``cycles=False`` gives the edges that phase 2 uses (moves between experts, ``D -> b``);
    ``cycles=True`` adds ``b -> S``, ``S -> a`` and ``a -> D`` for phase 3.
    """
    _n, e = a.shape
    sink, drop = e, e + 1
    gain = np.full((e + 2, e + 2), -np.inf)
    token = np.full((e + 2, e + 2), -1, dtype=np.int64)
    load = held.sum(axis=0)
    spare = load < cap
    open_slots = k - held.sum(axis=1)
    for src in range(e):
        on = np.flatnonzero(held[:, src])
        if on.size == 0:
            continue
        move = np.where(held[on], -np.inf, a[on] - a[on, src][:, None])
        best = move.argmax(axis=0)
        gain[src, :e] = move[best, np.arange(e)]
        token[src, :e] = on[best]
        if cycles and (open_slots > 0).any():
            worst = int(np.argmin(a[on, src]))
            gain[src, drop] = -a[on[worst], src]
            token[src, drop] = on[worst]
    needy = np.flatnonzero(open_slots > 0)
    if needy.size:
        enter = np.where(held[needy] | (cap == 0), -np.inf, a[needy])
        best = enter.argmax(axis=0)
        gain[drop, :e] = enter[best, np.arange(e)]
        token[drop, :e] = needy[best]
    if cycles:
        gain[:e, sink] = np.where(spare, 0.0, -np.inf)
        gain[sink, :e] = 0.0
    return _Graph(gain, token, spare, open_slots)


def _bellman_ford(
    gain: np.ndarray, dist: np.ndarray, tol: float, relaxations: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Longest paths with every edge charged ``tol``, at most ``relaxations`` rounds; returns
    ``(dist, pred, settled)``."""
    v = gain.shape[0]
    pred = np.full(v, -1, dtype=np.int64)
    charged = gain - tol
    for _ in range(min(relaxations, v + 1)):
        cand = dist[:, None] + charged
        src = cand.argmax(axis=0)
        best = cand[src, np.arange(v)]
        better = best > dist
        if not better.any():
            return dist, pred, True
        dist = np.where(better, best, dist)
        pred = np.where(better, src, pred)
    return dist, pred, False


def _apply(held: np.ndarray, graph: _Graph, path: list[int]) -> None:
    """Carry out the moves of the edges ``path[0] -> path[1] -> ...`` (no edge into ``S``)."""
    e = held.shape[1]
    for u, v in itertools.pairwise(path):
        if u == e or v == e:  # edges through S move no token
            continue
        t = graph.token[u, v]
        if u < e:
            held[t, u] = False
        if v < e:
            held[t, v] = True


# --- phase 2 ---------------------------------------------------------------------------------


def _augment(graph: _Graph, held: np.ndarray, cap: np.ndarray, tol: float, relaxations: int) -> int:
    """One round of phase 2: apply node-disjoint augmenting paths ``D -> ... -> spare expert``.

    A positive cycle (the auction leaves some) keeps Bellman-Ford from settling: the paths found
    anyway are used (a walk that loops is skipped); only if none is found are the edges charged
    more, which makes every cycle negative eventually. Returns the number of paths applied (0:
    no open slot can be filled, the flow is maximum).
    """
    e = held.shape[1]
    drop = e + 1
    start = np.full(e + 2, -np.inf)
    start[drop] = 0.0
    charge = tol
    while True:
        dist, pred, settled = _bellman_ford(graph.gain, start, charge, relaxations)
        applied = _apply_paths(graph, held, cap, dist, pred)
        if applied:
            return applied
        if relaxations <= e + 2:
            relaxations = e + 3  # the capped search may have stopped short of a path
        elif settled:
            return 0  # a complete search found no path: the flow is maximum
        else:
            charge *= 16


def _tree_path(pred: np.ndarray, target: int, root: int) -> list[int] | None:
    """The path ``root -> ... -> target`` of the predecessor tree ``pred``; None if ``target``
    does not reach ``root`` or the walk loops (a positive cycle left the search unsettled)."""
    path = [target]
    while path[-1] != root and pred[path[-1]] >= 0 and len(path) <= len(pred):
        path.append(int(pred[path[-1]]))
    if path[-1] != root or len(set(path)) != len(path):
        return None
    return path[::-1]


def _apply_paths(
    graph: _Graph, held: np.ndarray, cap: np.ndarray, dist: np.ndarray, pred: np.ndarray
) -> int:
    """Apply the node-disjoint paths of ``pred`` from D to spare experts, best first."""
    e = held.shape[1]
    drop = e + 1
    order = np.argsort(-dist[:e], kind="stable")
    claimed = np.zeros(e + 2, dtype=bool)
    open_left = graph.open_slots.copy()
    applied = 0
    for b in order:
        if applied >= graph.open_slots.sum():
            break
        if not (graph.spare[b] and np.isfinite(dist[b])):
            continue
        path = _tree_path(pred, int(b), drop)
        if path is None:
            continue
        first = graph.token[drop, path[1]]
        if claimed[path[1:]].any() or open_left[first] == 0:
            continue
        claimed[path[1:]] = True
        open_left[first] -= 1
        _apply(held, graph, path)
        applied += 1
    return applied


def _to_sink(graph: _Graph, held: np.ndarray, tol: float) -> int:
    """One round of phase 2's last part, with spare capacity: longest paths from ``S`` (edges
    ``S -> a``, gain 0, for every expert ``a`` holding a token; every edge charged ``tol``) to
    the experts with a free slot; each such path of positive gain, closed by ``b -> S``, is a
    positive cycle through ``S`` (a token leaves ``a``, ..., a token takes ``b``'s free slot).
    Every such path of the tree that shares no expert with a better one is applied; returns how
    many (0: none is left).

    Cycle cancelling (phase 3) finds these cycles too, but at most one a round (they all pass
    through ``S``): where an auction's restart left free slots priced above the rest, its budget
    runs out far from the optimum.
    """
    e = held.shape[1]
    sink = e
    gain = graph.gain.copy()
    gain[e + 1, :] = -np.inf  # no edge of D: every slot is filled
    gain[sink, :e] = np.where(held.any(axis=0), 0.0, -np.inf)
    start = np.full(e + 2, -np.inf)
    start[sink] = 0.0
    dist, pred, _ = _bellman_ford(gain, start, tol, e + 3)
    claimed = np.zeros(e + 2, dtype=bool)
    applied = 0
    for b in np.argsort(-dist[:e], kind="stable"):
        if not (graph.spare[b] and dist[b] > 0.0):
            continue
        path = _tree_path(pred, int(b), sink)
        if path is None or claimed[path[1:]].any():
            continue  # shares an expert with a better path
        claimed[path[1:]] = True
        _apply(held, graph, path)
        applied += 1
    return applied


# --- phase 3 ---------------------------------------------------------------------------------


def _cancel(graph: _Graph, held: np.ndarray, tol: float, relaxations: int) -> bool:
    """One round of phase 3: apply every cycle of the predecessor graph; False if none."""
    v = graph.gain.shape[0]
    _dist, pred, _ = _bellman_ford(graph.gain, np.zeros(v), tol, relaxations)
    # Nodes on cycles: the image of pred^(2^m) for 2^m >= V (roots map to themselves).
    jump = np.where(pred >= 0, pred, np.arange(v))
    for _ in range(max(1, math.ceil(math.log2(v)))):
        jump = jump[jump]
    on_cycle = np.zeros(v, dtype=bool)
    on_cycle[jump] = True
    on_cycle &= pred >= 0
    if not on_cycle.any():
        return False
    done = np.zeros(v, dtype=bool)
    for start in np.flatnonzero(on_cycle):
        if done[start]:
            continue
        cycle = [int(start)]
        done[start] = True
        node = int(pred[start])
        while node != start:
            cycle.append(node)
            done[node] = True
            node = int(pred[node])
        cycle.append(int(start))
        cycle.reverse()  # pred[v] -> v order
        _apply(held, graph, cycle)
    return True
