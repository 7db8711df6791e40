"""The global solver of Eq. (8) as CUDA kernels (``kernels/``): the starting prices
(``dual_prices.cu``), then the solver (``global_auction.cu``, its phases in the ``*.cuh``
headers it includes).

The solver kernel runs the three phases of :mod:`.global_reference` (auction, augmenting paths,
cycle cancelling on the expert graph) with one thread block per routing group. Its starting
prices (:func:`.global_reference.dual_prices`) come from a kernel launched just before it with a
cluster of up to ``MAX_CLUSTER`` blocks per group (compute capability 9.0; one block below), so
that this dense part spreads over the SMs that one block per group leaves idle. The solver's
per-group state lives in shared memory when it fits and in a global scratch buffer otherwise, so
any group size works; groups of up to a few thousand tokens fit in shared memory (see
:func:`work_bytes`).

The sources are compiled at first use for each shape and budget with NVRTC and launched on the
current stream (:mod:`.cuda_runtime`), so calls are capturable in CUDA graphs and need no host
sync; each shape's launch is planned once (:func:`_solver_launch`, :func:`_price_launch`), so a
call only allocates its outputs and launches. Where NVRTC or PyTorch's module loader is missing,
:func:`available` is false. The router's build has no profiling; :func:`solve_cuda` with
``stats`` compiles the debug build (``MAXSCORE_FLOW_DEBUG``: clocks, round counts and the tests'
hooks; the same assignment).

Determinism (what ``--deterministic`` relies on; torch's switch does not reach these kernels):
the assignment is a function of the input on one GPU type. ``dual_prices.cu`` has no atomics
(each block adds the cluster's column sums in rank order: the same prices in every block and
run). In ``global_auction.cu`` the setup has no float atomics, and every other atomic either
gives a result independent of the order threads arrive in or fills a list whose order the
result does not depend on: float max / min through their order-preserving integer images
(``atomic_max_float``, the graph's gains and ``worst``: exact and commutative); 64-bit
(value, index) keys, a total order (``tree_best``, the frontier search's labels, "so the labels
the search ends with do not depend on the order in which the warps' relaxations land"); bit
masks (atomicOr / atomicAnd); integer counters whose offsets order the open-token list ("its
order does not matter: bids are ranked per expert"), the bid buffers (bids ranked by value,
then lower token; an overflowing expert's ``BUF`` best chosen by value, then record index,
"deterministically from the bidders' own records") and the expert lists (each expert's work
its own); and the moves' atomicCAS (phases 2 and 3) that puts a joined expert in a token's
first free entry, whose position no later step depends on (a token's entries are read as a
set; the output is sorted by affinity, ties to the lower expert). Every choice breaks ties by
index (warp argmax and Dijkstra's argmin to the lower index, an edge's token the lowest among
equals), and the node-disjoint paths / cycles of a round never move two tokens into one
expert. ``benchmarks/determinism/measure.py`` solves one input twice and compares the
assignments index for index, and same-seed maxscore runs with ``--deterministic`` end with
equal validation losses (``tests/test_deterministic.py``). Another GPU type can plan another
launch (the prices' cluster size from the SM count and occupancy, the memory plan from the
shared memory), whose float sums may round differently: reproducible per GPU type only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .cuda_runtime import (
    KernelCompileError,
    available,
    compiled_kernel,
    kernel_headers,
    kernel_source,
    launch,
    resident_clusters,
)
from .global_reference import RELEASE_SLACK, GlobalBudget, stop_open_slots

__all__ = [
    "DEBUG_DEFINE",
    "DEBUG_STATS",
    "MAX_EXPERTS",
    "MAX_K",
    "MAX_SLOTS",
    "KernelCompileError",
    "available",
    "block_bytes",
    "compiled_size",
    "disable",
    "kernel_defines",
    "kernel_headers",
    "kernel_source",
    "launch_defines",
    "phase1_bytes",
    "price_cluster",
    "price_defines",
    "price_shared_bytes",
    "shared_and_scratch_bytes",
    "solve_cuda",
    "start_prices",
    "supported",
    "work_bytes",
]

MAX_EXPERTS = 256  # a warp's lanes hold E / 32 experts each in the bidding and graph scans
MAX_K = 8  # a token's open entry is packed in 4 bits; 8 keeps the per-token loops short
MAX_SLOTS = 1 << 27  # n k below this: bid records pack (token << 4 | entry) in an int
MIN_CAPABILITY = (8, 0)
# The solver kernel's debug build (kernels/debug_hooks.cuh): statistics per group, of
# DEBUG_STATS ints each.
DEBUG_DEFINE, DEBUG_STATS = "MAXSCORE_FLOW_DEBUG", 20
# The starting prices' kernel: a cluster of up to MAX_CLUSTER blocks per group (the portable
# cluster size), each taking at least MIN_CLUSTER_ROWS tokens and MIN_CLUSTER_ENTRIES
# affinities (below, the cluster's barriers cost more than the work they split:
# benchmarks/flow_solver/price_clusters.py); blocks of up to PRICE_THREADS threads.
MAX_CLUSTER, MIN_CLUSTER_ROWS, MIN_CLUSTER_ENTRIES, PRICE_THREADS = 8, 64, 8192, 512
MIN_CLUSTER_CAPABILITY = (9, 0)
THREADS = 512
# Larger blocks from this many experts: the expert rows and the auction's merges run a warp per
# expert, so more warps shorten them. Only where the larger Block struct leaves the memory plan
# as it is (at e = 256, k = 8 the state would leave shared memory); 1,024 threads would spill
# registers.
WIDE_THREADS, WIDE_FROM_EXPERTS = 768, 64
BID_BUFFER = 128  # bids an expert takes per auction round at most (more wait a round)
# How an auction round bids: a warp per open token above SMALL_E experts whatever the number of
# open tokens (a thread per token reads a long row alone); up to SMALL_E, a warp per token in
# rounds with at most SMALL_E_WARP_BID_TOKENS open tokens (the tail) and a thread per token in
# the others (the warps would take many short rows one after another).
SMALL_E, SMALL_E_WARP_BID_TOKENS = 32, 64
# Phase 2's search: the frontier search (every warp) from this many experts, Dijkstra in one warp
# below (Dijkstra's V dependent steps each wait for a row, the frontier search's passes each
# cost a block barrier: the passes win on large graphs, the steps on small ones).
FRONTIER_FROM_EXPERTS = 128

_disabled_reason: str | None = None


def disable(reason: str) -> None:
    """Stop offering the kernel in this process (:func:`supported` is false from now on)."""
    global _disabled_reason
    _disabled_reason = reason


def compiled_size(n: int) -> int:
    """The size the kernel is compiled for that serves ``n`` (tokens per group, or holders per
    expert): the smallest of 32, 48, 64, 96, 128, 192, ... (powers of two and their halfway
    points) that is ``>= n``. Each size is a separate NVRTC compile (seconds), so callers whose
    group size changes from call to call (evaluation batches padded to their longest sequence)
    pad to these sizes instead: a handful of compiles, at most a third more tokens."""
    size = 32
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _threads(n: int) -> int:
    return min(THREADS, 32 * max(1, math.ceil(n / 32)))


#: The constants that say where the state, the expert graph and the affinities live.
MEMORY_FLAGS = ("STATE_SMEM", "GRAPH_SMEM", "GRAPH_IN_WORK", "A_SMEM")


def kernel_defines(
    n: int,
    e: int,
    k: int,
    holders: int,
    budget: GlobalBudget,
    *,
    shared_bytes: int | None = None,
    overrides: dict[str, str] | None = None,
) -> dict[str, str]:
    """The compile-time constants of the kernel for one shape, capacity bound and budget.

    ``holders``: the most tokens an expert can hold (the largest capacity, clamped to ``n``).
    ``shared_bytes``: the dynamic shared memory a block may use (``None``: only the state, in
    shared memory); the expert graph and then the affinities go there too where they fit.
    ``overrides``: constants to use instead of these (kernel experiments, e.g. ``THREADS``),
    set before the memory is planned, so the plan counts them; a memory flag among them
    (``STATE_SMEM``, ``GRAPH_SMEM``, ``GRAPH_IN_WORK``, ``A_SMEM``) is kept as given.
    """
    overrides = overrides or {}
    cb = max(1, min(holders, n))
    scales = (*budget.epsilon_scales_for(n), 1, 1)
    defines = {
        "N": str(n),
        "E": str(e),
        "K": str(k),
        "THREADS": str(_threads(n)),
        "CB": str(cb),
        "BUF": str(min(BID_BUFFER, max(2 * cb, 32))),
        "AUCTION": str(max(0, budget.auction_rounds)),
        "STOP_OPEN": str(stop_open_slots(n, k, budget)),
        "SINK_ROUNDS": str(budget.sink_rounds_for(n, k)),
        "CANCELS": str(max(0, budget.cancel_rounds)),
        "RELAX_CANCEL": str(max(1, min(budget.relaxations, e + 3))),
        "EPS_REL": f"{float(budget.epsilon)!r}f",
        # eps-scaling's earlier auctions (1: none)
        "EPS_SCALE": str(scales[0]),
        "EPS_SCALE2": str(scales[1]),
        "PRICE_ITERS": str(budget.price_iterations),
        "TOL_REL": f"{float(budget.tolerance)!r}f",
        "RELEASE_SLACK": f"{RELEASE_SLACK!r}f",
        "WARP_BID_TOKENS": str(n if e > SMALL_E else SMALL_E_WARP_BID_TOKENS),
        # the overflowing experts' bid records listed by expert (4 bytes a record of state);
        # plan_launch turns it off where that space would move the state out of shared memory
        "COMPACT": "1",
        "SEARCH_FRONTIER": "1" if e >= FRONTIER_FROM_EXPERTS else "0",
        **overrides,
    }
    state, graph, affinities = work_bytes(defines), 4 * (e + 2) ** 2, 4 * n * e
    room = shared_bytes if shared_bytes is not None else state
    defines["STATE_SMEM"] = "1" if state <= room else "0"
    room -= state if state <= room else 0
    defines["GRAPH_SMEM"] = "1" if graph <= room else "0"
    room -= graph if graph <= room else 0
    # A graph that does not fit beside the state may take the place of phase 1's bids in it.
    in_work = defines["GRAPH_SMEM"] == "0" and graph <= phase1_bytes(defines)
    defines["GRAPH_IN_WORK"] = "1" if in_work else "0"
    defines["A_SMEM"] = "1" if affinities <= room else "0"
    return {**defines, **{key: v for key, v in overrides.items() if key in MEMORY_FLAGS}}


def _bid_record_words(defines: dict[str, str]) -> int:
    """Words of phase 1's bid records: expert and value of each, and with ``COMPACT`` their list
    by expert."""
    n, k = int(defines["N"]), int(defines["K"])
    return (3 if defines["COMPACT"] == "1" else 2) * n * k


def phase1_bytes(defines: dict[str, str]) -> int:
    """Bytes at the end of the state that only phase 1 uses (the bids and their records)."""
    e, buf = int(defines["E"]), int(defines["BUF"])
    return 4 * (2 * e * buf + _bid_record_words(defines))


def block_bytes(defines: dict[str, str]) -> int:
    """The kernel's static shared memory (its ``Block`` struct) for these constants, the debug
    build's clocks included: both builds get the same memory plan."""
    e, buf = int(defines["E"]), int(defines["BUF"])
    warps, v = int(defines["THREADS"]) // 32, e + 2
    words = (
        3 * warps * buf  # rank, wsort, widx
        + 3 * warps  # warp_max, warp_rows, part_worst
        + 5 * e  # price, reserve, cap, held, nbid
        + 7 * v  # dist, dist_next, pot, pred, jump, jump_next, on_cycle
        + 2 * e  # tree_best (8 bytes each)
        + v  # drop_token
        + 4 * e  # dirty, expert_list, col_rows, worst
        + 2  # experts_listed, ncol
        + 3  # lo_ord, hi_ord, real_rows
        + 4  # lo, hi, eps, tol
        + 4  # open_count, open_tokens, moves, overflowed
        + 1  # spare
    )
    return 4 * words + 8 * 12 + 16  # the debug build's prof; alignment padding


def shared_and_scratch_bytes(defines: dict[str, str], groups: int) -> tuple[int, int]:
    """(dynamic shared memory per block, global scratch bytes) of a launch."""
    n, e = int(defines["N"]), int(defines["E"])
    state, graph, affinities = work_bytes(defines), 4 * (e + 2) ** 2, 4 * n * e
    shared = scratch = 0
    for flag, size in (("STATE_SMEM", state), ("GRAPH_SMEM", graph), ("A_SMEM", affinities)):
        if defines[flag] == "1":
            shared += size
        elif flag == "STATE_SMEM" or (flag == "GRAPH_SMEM" and defines["GRAPH_IN_WORK"] == "0"):
            scratch += groups * size  # (the affinities are read where they are)
    return shared, scratch


def work_bytes(defines: dict[str, str]) -> int:
    """Bytes of one group's state (the kernel's ``WORK_BYTES``; the graph and affinities apart)."""
    n, e, k = int(defines["N"]), int(defines["E"]), int(defines["K"])
    cb, buf = int(defines["CB"]), int(defines["BUF"])
    warps = int(defines["THREADS"]) // 32
    v, mw = e + 2, (e + 31) // 32
    words = n * k + n * mw + 2 * e * cb + 2 * e * buf + n + 3 * v + e * mw + (n + 31) // 32
    words += _bid_record_words(defines)
    return 4 * (words + warps * e)


def price_cluster(
    n: int,
    e: int,
    groups: int,
    sm_count: int,
    capability: tuple[int, int],
    resident: Callable[[int], int | None] | None = None,
) -> int:
    """Blocks per group of the starting prices' kernel: the largest of 2, 3, 4, 6 and 8 (at
    most ``MAX_CLUSTER``) that leaves at least ``MIN_CLUSTER_ROWS`` tokens and
    ``MIN_CLUSTER_ENTRIES`` affinities (``n x e``) a block and lets all
    ``groups`` clusters run at once: ``resident(c)``, the clusters of ``c`` blocks the GPU holds
    at once (the driver's occupancy query: a cluster's blocks share a GPC, so a GPU may hold
    fewer clusters than its SM count suggests), where it answers, else ``c * groups <=
    sm_count``; 1 below compute capability 9.0 (no thread-block clusters)."""
    cluster = 1
    if capability < MIN_CLUSTER_CAPABILITY:
        return cluster
    for c in (2, 3, 4, 6, 8):
        if c > MAX_CLUSTER or n < c * MIN_CLUSTER_ROWS or n * e < c * MIN_CLUSTER_ENTRIES:
            break
        held = resident(c) if resident is not None else None
        if (held if held is not None else sm_count // c) >= groups:
            cluster = c
    return cluster


def price_resident_clusters(defines: dict[str, str], kernel, groups: int) -> int | None:
    """:func:`.cuda_runtime.resident_clusters` for the prices' kernel compiled with
    ``defines``, launched for ``groups`` groups (a cluster of ``CLUSTER`` blocks each)."""
    blocks = groups * int(defines["CLUSTER"])
    return resident_clusters(kernel, blocks, int(defines["THREADS"]), price_shared_bytes(defines))


def _segment(e: int, rows_per_warp: int) -> int:
    """Lanes a token's row spreads over in the prices' kernel (its SEG, a power of two): the
    fewest shuffles an iteration, each lane's rows' sums taking log2(SEG) steps each and its
    experts' column sums log2(32 / SEG) (at most 8 experts a lane: registers)."""

    def shuffles(seg: int) -> tuple[int, int]:
        lane_rows = -(-rows_per_warp * seg // 32)
        lane_experts = -(-e // seg)
        log_seg = seg.bit_length() - 1
        return lane_rows * log_seg + lane_experts * (5 - log_seg), -seg

    top = min(32, 1 << max(0, (e - 1).bit_length()))  # a row needs no more lanes than experts
    segs = [1 << i for i in range(6) if (1 << i) <= top and -(-e // (1 << i)) <= 8]
    return min(segs or [top], key=shuffles)


def price_defines(n: int, e: int, k: int, budget: GlobalBudget, cluster: int) -> dict[str, str]:
    """The compile-time constants of the starting prices' kernel (``dual_prices.cu``): at least
    4 tokens a warp, up to ``PRICE_THREADS`` threads a block."""
    rows = -(-n // cluster)
    warps = min(PRICE_THREADS // 32, max(1, -(-rows // 4)))
    return {
        "N": str(n),
        "E": str(e),
        "K": str(k),
        "THREADS": str(32 * warps),
        "CLUSTER": str(cluster),
        "SEG": str(_segment(e, -(-rows // warps))),
        "PRICE_ITERS": str(budget.price_iterations),
        "PRICE_T0": f"{float(budget.price_temperatures[0])!r}f",
        "PRICE_T1": f"{float(budget.price_temperatures[1])!r}f",
    }


def price_shared_bytes(defines: dict[str, str]) -> int:
    """Dynamic shared memory of a block of the prices' kernel (its ``SH_FLOATS``; at most 41
    KiB, whatever the group size)."""
    e, warps = int(defines["E"]), int(defines["THREADS"]) // 32
    return 4 * (2 * e + 2 * warps * e + 6 * e + 4 * warps + 4)


def supported(affinities: Tensor, k: int) -> bool:
    """Whether the kernel handles this shape and device (any group size; ``e <= 256``,
    ``k <= 8``, a CUDA GPU of compute capability 8.0 or newer with NVRTC)."""
    if affinities.dim() != 3 or not affinities.is_cuda or _disabled_reason or not available():
        return False
    _, n, e = affinities.shape
    if not (n >= 1 and 1 <= e <= MAX_EXPERTS and 1 <= k <= min(e, MAX_K)):
        return False
    if n * k >= MAX_SLOTS:
        return False
    return _capable(_device_index(affinities))


def _device_index(tensor: Tensor) -> int:
    index = tensor.device.index
    return index if index is not None else torch.cuda.current_device()


@functools.cache
def _capable(device_index: int) -> bool:
    """Whether GPU ``device_index`` has the compute capability the kernels need (asked once:
    the router calls :func:`supported` on every routing call)."""
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor) >= MIN_CAPABILITY


def plan_launch(
    optin: int, n: int, e: int, k: int, holders: int, budget: GlobalBudget
) -> dict[str, str]:
    """The kernel's constants for a block of ``optin`` bytes of shared memory: the dynamic shared
    memory gets what the Block struct leaves (the struct's size does not depend on the memory
    flags, so any flags give it). From ``WIDE_FROM_EXPERTS`` experts, where the narrower choice
    is a full ``THREADS`` block, blocks of ``WIDE_THREADS`` where that plan puts the state, the
    graph and the affinities where the narrower one does. The list of overflowing bids
    (``COMPACT``) only where its space leaves that choice as it is (not at e = 256, k = 8,
    whose state would leave shared memory)."""

    def plan(overrides: dict[str, str]) -> dict[str, str]:
        room = optin - block_bytes(kernel_defines(n, e, k, holders, budget, overrides=overrides))
        return kernel_defines(n, e, k, holders, budget, shared_bytes=room, overrides=overrides)

    def blocks(compact: str) -> dict[str, str]:
        narrow = plan({"COMPACT": compact})
        if e >= WIDE_FROM_EXPERTS and narrow["THREADS"] == str(THREADS):
            wide = plan({"COMPACT": compact, "THREADS": str(WIDE_THREADS)})
            if all(wide[flag] == narrow[flag] for flag in MEMORY_FLAGS):
                return wide
        return narrow

    # The bid records' list only where it leaves the block and the memory plan as they are.
    listed, plain = blocks("1"), blocks("0")
    same = all(listed[key] == plain[key] for key in ("THREADS", *MEMORY_FLAGS))
    return listed if same else plain


@functools.cache
def launch_defines(
    device_index: int, n: int, e: int, k: int, holders: int, budget: GlobalBudget
) -> tuple[tuple[str, str], ...]:
    """:func:`plan_launch` for this device (worked out once per shape)."""
    optin = torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin
    return tuple(plan_launch(optin, n, e, k, holders, budget).items())


@functools.cache
def _price_launch(
    device_index: int, n: int, e: int, k: int, budget: GlobalBudget, groups: int
) -> _Launch:
    """The prices' kernel's launch (its constants, cluster size and loaded kernel) for this
    device, shape and number of groups (planned and compiled once; :func:`price_cluster`
    compiles each cluster size it asks the driver about)."""
    props = torch.cuda.get_device_properties(device_index)

    def load(cluster: int) -> tuple[dict[str, str], object]:
        defines = price_defines(n, e, k, budget, cluster)
        kernel = compiled_kernel(
            device_index,
            tuple(defines.items()),
            price_shared_bytes(defines),
            "dual_prices.cu",
            "dual_prices_kernel",
        )
        return defines, kernel

    def resident(cluster: int) -> int | None:
        return price_resident_clusters(*load(cluster), groups)

    capability = (props.major, props.minor)
    cluster = price_cluster(n, e, groups, props.multi_processor_count, capability, resident)
    defines, kernel = load(cluster)
    return _Launch(
        kernel,
        int(defines["THREADS"]),
        price_shared_bytes(defines),
        cluster=cluster,
        defines=tuple(defines.items()),
    )


def solve_cuda(
    affinities: Tensor,
    k: int,
    capacity: Tensor,
    holders: int,
    budget: GlobalBudget,
    *,
    token_mask: Tensor | None = None,
    stats: Tensor | None = None,
) -> Tensor:
    """Run the kernel on ``affinities[G, n, e]`` (CUDA) with ``capacity[G, e]`` (each ``<=
    holders``; larger values are clamped to it, so ``holders`` must bound them).

    Returns ``[G, n, k]`` long expert indices, each token's experts by decreasing affinity (ties:
    lower expert), ``-1`` last. ``token_mask`` (``[G, n]`` bool), if given, marks the real
    tokens; padded ones take no expert. ``stats`` (``[G, DEBUG_STATS]`` int32), if given, runs
    the kernel's debug build (``MAXSCORE_FLOW_DEBUG``, ``kernels/debug_hooks.cuh``: the same
    assignment, with SM-cycle clocks and extra barriers) and receives per group the rounds of
    each phase and the clocks of its parts; for the benchmarks' profiles, never the router's
    path.
    """
    if not supported(affinities, k):
        raise ValueError(
            "the CUDA global-solver kernel does not apply: it needs CUDA tensors [G, n, e] with "
            f"e <= {MAX_EXPERTS}, 1 <= k <= min(e, {MAX_K}), a GPU of compute capability >= 8.0 "
            "and NVRTC"
        )
    groups, n, e = affinities.shape
    a = affinities.float().contiguous()
    cap = capacity.to(device=a.device, dtype=torch.int32).expand(groups, e).contiguous()
    out = torch.empty(groups, n, k, dtype=torch.long, device=a.device)
    if groups == 0:
        return out
    device_index = _device_index(a)
    plan = _solver_launch(device_index, groups, n, e, k, holders, budget, stats is not None)
    scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=a.device)
    mask = None
    if token_mask is not None:
        mask = token_mask.to(device=a.device, dtype=torch.uint8).expand(groups, n).contiguous()
    start = start_prices(a, k, cap, budget, mask, device_index)
    prices, first_experts, first_values = (
        (start.prices, start.first_experts, start.first_values)
        if start is not None
        else (scratch, scratch, scratch)
    )
    args = [
        a,
        cap,
        out,
        scratch,
        mask if mask is not None else scratch,
        0 if mask is None else 1,
        prices,
        first_experts,
        first_values,
    ]
    if stats is not None:  # the debug build: its statistics, its hooks' counters (unused), off
        args += [stats, torch.zeros(4, dtype=torch.int32, device=a.device), 0]
    launch(plan.kernel, device_index, (groups, 1, 1), (plan.threads, 1, 1), args, plan.shared)
    return out


class _Launch(NamedTuple):
    """A kernel's launch for one device, shape and budget, worked out once (:func:`_solver_launch`,
    :func:`_price_launch`): the router launches the same few shapes every step, so a call does
    no planning, no define parsing and no cache lookup over the kernel's constants."""

    kernel: object  # torch.cuda._utils._CudaKernel
    threads: int
    shared: int  # dynamic shared memory per block
    scratch_bytes: int = 1  # the solver's global scratch (at least 1: an allocatable size)
    cluster: int = 1  # blocks per group (the prices' kernel)
    defines: tuple[tuple[str, str], ...] = ()


@functools.cache
def _solver_launch(
    device_index: int,
    groups: int,
    n: int,
    e: int,
    k: int,
    holders: int,
    budget: GlobalBudget,
    debug: bool,
) -> _Launch:
    """The solver kernel's launch (:func:`launch_defines`, its memory plan, the loaded
    kernel; the debug build with ``debug``) for ``groups`` groups of this shape."""
    items = launch_defines(device_index, n, e, k, holders, budget)
    defines = dict(items)
    dynamic, scratch_bytes = shared_and_scratch_bytes(defines, groups)
    if debug:
        items = (*items, (DEBUG_DEFINE, "1"))
    kernel = compiled_kernel(device_index, items, dynamic)
    return _Launch(kernel, int(defines["THREADS"]), dynamic, max(1, scratch_bytes), 1, items)


class StartPrices(NamedTuple):
    """What ``dual_prices.cu`` leaves for the solver kernel (:func:`start_prices`)."""

    prices: Tensor  # [G, e] starting prices, the lowest expert with capacity at 0
    duals: Tensor  # [G, n] each token's u_t at those prices
    # [G, n, k] int32: the experts above u_t in ascending order where exactly k are, else -1 in
    # every entry (and then the token selects its first bids one by one)
    first_experts: Tensor
    first_values: Tensor  # [G, n, k] A_tj - w for those experts (w: the best of the rest)


def start_prices(
    a: Tensor,
    k: int,
    cap: Tensor,
    budget: GlobalBudget,
    mask: Tensor | None,
    device_index: int,
) -> StartPrices | None:
    """``[G, e]`` starting prices (:func:`.global_reference.dual_prices`) from ``dual_prices.cu``
    on ``a`` (``[G, n, e]`` float32, contiguous, on GPU ``device_index``) with ``cap`` (``[G,
    e]`` int32, contiguous) and ``mask`` (``[G, n]`` uint8, or ``None``: every token real),
    launched on the current stream, with each token's dual ``u_t`` at those prices and the
    auction's first bids (:class:`StartPrices`: the experts above ``u_t`` where exactly ``k``
    are, which the auction's first round bids for without selecting them); the solver kernel
    reads them where the capacities do not exceed the demand. ``None`` without dual
    iterations."""
    if budget.price_iterations <= 0:
        return None
    groups, n, e = a.shape
    plan = _price_launch(device_index, n, e, k, budget, groups)
    prices = torch.empty(groups, e, dtype=torch.float32, device=a.device)
    duals = torch.empty(groups, n, dtype=torch.float32, device=a.device)  # the tokens' u_t
    first_experts = torch.empty(groups, n, k, dtype=torch.int32, device=a.device)
    first_values = torch.empty(groups, n, k, dtype=torch.float32, device=a.device)
    launch(
        plan.kernel,
        device_index,
        (groups * plan.cluster, 1, 1),
        (plan.threads, 1, 1),
        [
            a,
            cap,
            mask if mask is not None else cap,
            0 if mask is None else 1,
            prices,
            duals,
            first_experts,
            first_values,
        ],
        plan.shared,
    )
    return StartPrices(prices, duals, first_experts, first_values)
