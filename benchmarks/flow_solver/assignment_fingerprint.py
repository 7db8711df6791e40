"""The global solver's assignments as fingerprints, to compare two versions of its kernels.

``run`` solves a fixed, seeded set of problems with the CUDA backend (``solve_global``, the
public API only, so any version of the package runs it) and writes, per problem, a SHA-256 of
the ``[G, n, k]`` expert indices, the objective of Eq. (8) summed over the groups, whether two
calls gave the same indices, and the milliseconds a call takes (the call replayed in a CUDA
graph, median of ``--reps`` replays). ``compare A.json B.json`` reports which problems got
identical assignments and the time ratio B / A (exit status 1 if any assignment differs).

Problems (``n = 512`` tokens a group, 32 groups, capacity ``ceil(factor k n / e)``): the
families random, skewed, ties, one-hot and near-tied (``bench.py``'s, noise 0.03) at
``e = 16, 64, 128, 256`` and ``k = 2, 6, 8``, capacity factor 1; random, one-hot and near-tied
with a quarter of spare capacity (factor 1.25, phase 2's paths from the sink); groups of 500
tokens (padded to the compiled size with masked tokens); and two routers' captured scores
(``tests/data/router_scores.npz``).

To compare with an earlier kernel, run this same file against both source trees (the earlier
commit checked out elsewhere), on the same GPU, then compare:

    git worktree add /tmp/old aa2bf1a
    PYTHONPATH=/tmp/old/src python benchmarks/flow_solver/assignment_fingerprint.py run \\
        --out old.json
    PYTHONPATH=src python benchmarks/flow_solver/assignment_fingerprint.py run --out new.json
    python benchmarks/flow_solver/assignment_fingerprint.py compare old.json new.json

``--backend reference`` runs the NumPy backend instead (CPU, wall-clock time; slow: pick a few
problems with ``--families``, ``--experts``, ``--ks`` and ``--groups``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from maxscore.routing.flow import flow_objective
from maxscore.routing.flow.global_solver import solve_global

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import graph_time_ms, synthetic  # noqa: E402

ROUTER_SCORES = HERE.parents[1] / "tests" / "data" / "router_scores.npz"
FAMILIES = ("random", "skewed", "ties", "one-hot", "near-tied-0.03")
SPARE_FAMILIES = ("random", "one-hot", "near-tied-0.03")
EXPERTS = (16, 64, 128, 256)
KS = (2, 6, 8)
SEED = 20261128


@dataclass(frozen=True)
class Problem:
    """One input: ``source`` is a synthetic family or ``router:KEY`` (captured scores)."""

    source: str
    n: int
    e: int
    k: int
    capacity_factor: float = 1.0

    @property
    def name(self) -> str:
        return f"{self.source} n={self.n} e={self.e} k={self.k} cf={self.capacity_factor}"

    @property
    def capacity(self) -> int:
        return math.ceil(self.capacity_factor * self.k * self.n / self.e)


def problems(args: argparse.Namespace) -> Iterator[Problem]:
    """The fixed problem set, narrowed by the command line."""
    for e in args.experts:
        for k in args.ks:
            for family in args.families:
                yield Problem(family, 512, e, k)
            for family in (f for f in SPARE_FAMILIES if f in args.families):
                if k != 6:  # k = 2 and 8 cover the spare-capacity paths
                    yield Problem(family, 512, e, k, 1.25)
    if "random" in args.families:
        for e, k in ((64, 6), (256, 8)):
            if e in args.experts and k in args.ks:
                yield Problem("random", 500, e, k)  # off the compiled sizes: padded, masked
    if args.router_scores:
        for key, k in (("e16_k2", 2), ("e64_k2", 2)):
            yield Problem(f"router:{key}", 512, int(key[1:].split("_")[0]), k)


def affinities(problem: Problem, groups: int) -> torch.Tensor:
    """``[G, n, e]`` float32 affinities of ``problem`` (CPU; the same on every run)."""
    if problem.source.startswith("router:"):
        with np.load(ROUTER_SCORES) as saved:
            return torch.from_numpy(saved[problem.source.split(":", 1)[1]].copy()).float()
    seed = SEED + 1000 * problem.e + 10 * problem.k + problem.n
    return synthetic(problem.source, groups, problem.n, problem.e, seed)


def assignment_hash(index: torch.Tensor) -> str:
    """SHA-256 of the expert indices (int64, row-major)."""
    data = index.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def wall_time_ms(call: Callable[[], torch.Tensor], reps: int) -> float:
    """Median milliseconds of ``call`` by the host clock (the CPU backend)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def fingerprint(problem: Problem, groups: int, backend: str, reps: int) -> dict[str, Any]:
    """Solve ``problem`` twice, then time it: its row of the JSON."""
    device = "cuda" if backend == "cuda" else "cpu"
    a = affinities(problem, groups).to(device)
    capacity = torch.full((problem.e,), problem.capacity, device=device)

    def call() -> torch.Tensor:
        return solve_global(
            a, problem.k, capacity, capacity_bound=problem.capacity, backend=backend
        )

    first, second = call(), call()
    ms = graph_time_ms(call, reps) if backend == "cuda" else wall_time_ms(call, reps)
    index = first.cpu()
    return {
        **asdict(problem),
        "name": problem.name,
        "groups": a.shape[0],
        "capacity": problem.capacity,
        "sha256": assignment_hash(index),
        "repeatable": bool(torch.equal(index, second.cpu())),
        "filled_slots": int((index >= 0).sum()),
        "objective": float(flow_objective(a.cpu().double(), index).sum()),
        "ms": ms,
    }


def source_revision() -> str | None:
    """The git commit of the imported ``maxscore`` package's tree, if it is a checkout
    (``-dirty``: with uncommitted changes)."""
    import maxscore

    folder = Path(maxscore.__file__).resolve().parent
    done = subprocess.run(
        ["git", "-C", str(folder), "describe", "--always", "--dirty", "--abbrev=12"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def run(args: argparse.Namespace) -> None:
    import maxscore

    if args.backend == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the cuda backend needs a GPU (--backend reference runs on the CPU)")
    device = torch.cuda.get_device_name() if args.backend == "cuda" else "cpu"
    out: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "torch": torch.__version__,
        "package": str(Path(maxscore.__file__).resolve().parent),
        "revision": source_revision(),
        "backend": args.backend,
        "reps": args.reps,
        "rows": [],
    }
    for problem in problems(args):
        row = fingerprint(problem, args.groups, args.backend, args.reps)
        out["rows"].append(row)
        print(f"{row['name']:42s} {row['sha256'][:16]} {row['ms']:9.3f} ms", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


def compare(first: Path, second: Path) -> int:
    """Print the comparison of two ``run`` files; the number of differing assignments."""
    a, b = (json.loads(path.read_text()) for path in (first, second))
    for name, run in (("A", a), ("B", b)):
        print(f"{name}: {run['revision'] or run['package']} ({run['device']}, {run['date']})")
    if a["device"] != b["device"]:
        print("warning: two devices; the assignments are reproducible per GPU type only")
    rows_b = {row["name"]: row for row in b["rows"]}
    differ, ratios = 0, []
    for row in a["rows"]:
        other = rows_b.get(row["name"])
        if other is None:
            print(f"{row['name']:42s} only in A")
            continue
        same = row["sha256"] == other["sha256"]
        differ += not same
        ratio = other["ms"] / row["ms"]
        ratios.append(ratio)
        gap = (other["objective"] - row["objective"]) / max(abs(row["objective"]), 1e-12)
        verdict = "identical" if same else f"DIFFERENT (objective B - A: {gap:+.1e} rel.)"
        print(
            f"{row['name']:42s} {verdict:40s} {row['ms']:8.3f} -> {other['ms']:8.3f} ms "
            f"(x{ratio:.3f})"
        )
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else math.nan
    print(
        f"{len(ratios) - differ} of {len(ratios)} assignments identical; time B / A: geometric "
        f"mean {geomean:.3f}, range {min(ratios, default=math.nan):.3f}-"
        f"{max(ratios, default=math.nan):.3f}"
    )
    return differ


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    solve = commands.add_parser("run", help="solve the problem set and write the JSON")
    solve.add_argument("--out", type=Path, required=True)
    solve.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    solve.add_argument("--reps", type=int, default=20)
    solve.add_argument("--groups", type=int, default=32, help="groups of each synthetic problem")
    solve.add_argument("--families", default=FAMILIES, type=lambda text: tuple(text.split(",")))
    solve.add_argument("--experts", default=EXPERTS, type=numbers)
    solve.add_argument("--ks", default=KS, type=numbers)
    solve.add_argument(
        "--no-router-scores", dest="router_scores", action="store_false", help="skip them"
    )
    check = commands.add_parser("compare", help="compare two run files: A (before), B (after)")
    check.add_argument("first", type=Path)
    check.add_argument("second", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        sys.exit(1 if compare(args.first, args.second) else 0)


if __name__ == "__main__":
    main()
