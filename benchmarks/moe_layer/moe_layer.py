"""MoE layer benchmark: forward + backward time, TFLOP/s and peak memory of one layer.

Run from the repository root on a GPU machine::

    PYTHONPATH=src python3 benchmarks/moe_layer/moe_layer.py [--out DIR] [--quick]

For T = 16,384 tokens (32 sequences of 512), E = 16 experts, k = 2, bf16, at D = 768 (expert
FFN 1536) and D = 2048 (FFN 4096) it times, in one process on one card:

* the maxscore MoE layer with the routers gshard, dropless, expert-choice, sbase, maxscore
  (router fp32, experts bf16), plus the router alone; routing statistics are lazy (not computed
  unless read), and one extra row reads them every step (``maxscore + stats read``);
* a dense SwiGLU MLP with the same active FLOPs (intermediate size k * F);
* transformers' MixtralSparseMoeBlock of the same shape with its experts implementations
  ``eager`` (the default of a stand-alone block), ``batched_mm`` and ``grouped_mm``.

Active FLOPs of Eq. (1)'s experts: forward ``6 * T * k * D * F`` (three matmuls, 2 FLOPs per
MAC), backward twice that, so ``18 * T * k * D * F`` per step (router FLOPs ignored, < 0.3%).
Peak memory is the largest allocation above the resting state (parameters, their gradients
from a warm-up step, the input) during one forward + backward, i.e. activations and workspace.

Writes ``moe_layer.json`` and ``moe_layer.md`` to ``--out`` (default ``$OUT`` or ``.``) and
prints the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from maxscore.moe import DenseMLP, MoE, dispatch_plan
from maxscore.moe import experts as experts_mod

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
import common

ROUTERS = [
    "gshard",
    "dropless",
    "expert-choice",
    "sbase",
    "maxscore",
    "maxscore@two-stage-sinkhorn",
]
HF_IMPLS = ["eager", "batched_mm", "grouped_mm"]
SHAPES = [(768, 1536), (2048, 4096)]
E, K, BATCH, SEQ = 16, 2, 32, 512
DEVICE = torch.device("cuda")  # --device cpu: a smoke run of the script itself (no numbers)


def timed(step: Callable[[], None], warmup: int, iters: int) -> tuple[float, list[float]]:
    """Median ms of ``step`` over ``iters`` runs (CUDA events; the host clock on the CPU)."""
    return common.timed(step, warmup, iters, cuda=DEVICE.type == "cuda")


def peak_extra_mb(step: Callable[[], None]) -> float:
    """Peak allocation above the resting state during one ``step`` (MiB)."""
    if DEVICE.type == "cpu":
        step()
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def make_step(module: nn.Module, x: Tensor, grad: Tensor, kind: str) -> Callable[[], None]:
    def step() -> None:
        out = module(x)
        if kind == "moe":
            y, result = out
            torch.autograd.backward([y, result.aux_loss + result.z_loss], [grad, None])
        else:
            out.backward(grad)

    return step


def hf_block(d: int, f: int, impl: str) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(
        hidden_size=d, intermediate_size=f, num_local_experts=E, num_experts_per_tok=K
    )
    cfg._experts_implementation = impl
    block = MixtralSparseMoeBlock(cfg)
    for p in block.parameters():  # transformers leaves these uninitialised outside a model
        nn.init.normal_(p, std=0.02)
    return block


def check_moe(moe: MoE, x: Tensor) -> dict[str, float]:
    """bf16 layer output vs an fp32 run of the same experts on the same routing; and the other
    execution path (grouped vs padded) on that routing."""
    with torch.no_grad():
        y, result = moe(x)
        tokens = x.reshape(-1, x.shape[-1])
        plan = dispatch_plan(result, moe.buffer_capacity(result))
        ref = (
            type(moe.experts)(E, moe.hidden_size, moe.intermediate_size)
            .to(x.device)
            .requires_grad_(False)
        )
        ref.gate_up.copy_(moe.experts.gate_up.float())
        ref.down.copy_(moe.experts.down.float())
        y32 = ref(tokens.float(), plan)
        rel = ((y.reshape(-1, x.shape[-1]).float() - y32).norm() / y32.norm()).item()
        out = {"rel_err_vs_fp32": rel}
        if result.capacity is not None:
            grouped = dispatch_plan(result, None)
            yg = moe.experts(tokens, grouped).float()
            out["grouped_rel_err_vs_fp32"] = ((yg - y32).norm() / y32.norm()).item()
    return out


def profile(module: nn.Module, step: Callable[[], None], path: str) -> None:
    """Per-kernel device time of 3 steps (where the time goes), written to ``path``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    try:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        avg = prof.key_averages()
        try:
            text = avg.table(sort_by="self_cuda_time_total", row_limit=30)
        except Exception:
            text = avg.table(sort_by="self_device_time_total", row_limit=30)
        with open(path, "w") as fh:
            fh.write(text)
    except Exception as exc:  # profiling is a diagnostic; never fail the benchmark on it
        print(f"profiler failed: {exc!r}")
    module.zero_grad(set_to_none=True)


def bench_shape(
    d: int, f: int, warmup: int, iters: int, log: Callable[[str], None], profile_dir: str = ""
) -> list[dict]:
    dev = DEVICE
    torch.manual_seed(0)
    x = torch.randn(BATCH, SEQ, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    t = BATCH * SEQ
    flops = 18 * t * K * d * f
    rows: list[dict] = []

    def record(name: str, kind: str, module: nn.Module, extra: dict | None = None) -> None:
        step = make_step(module, x, grad, kind)
        try:
            ms, all_ms = timed(step, warmup, iters)
            mem = peak_extra_mb(step)
            row = {"name": name, "ms": ms, "tflops": flops / ms / 1e9, "peak_mb": mem}
            row["all_ms"] = all_ms
        except Exception as exc:  # keep the run going; the row says what broke
            row = {"name": name, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        row.update(extra or {})
        row.update({"D": d, "F": f})
        rows.append(row)
        log(f"  {name:28s} {row.get('ms', float('nan')):8.3f} ms  {row.get('error', '')}")
        module.zero_grad(set_to_none=True)
        x.grad = None

    def record_experts_only(moe: MoE) -> None:
        """Dispatch plan + experts, forward + backward, on one fixed routing (no router)."""
        with torch.no_grad():
            _, result = moe(x)
        tokens = x.reshape(-1, d)
        cap = moe.buffer_capacity(result)
        weights = result.combine_weights.detach().requires_grad_(True)

        class _Experts(nn.Module):
            def forward(self, inp: Tensor) -> Tensor:
                r = result
                plan = dispatch_plan(
                    type(r)(
                        r.expert_index,
                        weights,
                        r.capacity,
                        r.num_groups,
                        r.logits,
                        r.affinities,
                        r.aux_loss,
                        r.z_loss,
                    ),
                    cap,
                )
                return moe.experts(inp.reshape(-1, d), plan).view_as(inp)

        wrapper = _Experts()
        wrapper.experts = moe.experts  # so zero_grad reaches the expert weights
        record("experts only (gshard routing)", "dense", wrapper)
        del tokens

    def sync_count(moe: MoE) -> int:
        """Host syncs CUDA reports during one layer forward + backward."""
        import warnings

        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                make_step(moe, x, grad, "moe")()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        moe.zero_grad(set_to_none=True)
        return sum("synchroniz" in str(w.message) for w in caught)

    dense = DenseMLP(d, K * f).to(dev, torch.bfloat16)
    record("dense SwiGLU (k*F)", "dense", dense)
    del dense

    for router in ROUTERS:
        preset, _, flow = router.partition("@")
        try:
            kw = {"flow_method": flow} if flow else {}
            moe = MoE(d, E, K, intermediate_size=f, router=preset, **kw).to(dev)
            moe.experts.to(torch.bfloat16)
        except Exception as exc:
            rows.append({"name": f"maxscore/{router}", "error": repr(exc), "D": d, "F": f})
            continue
        extra: dict[str, Any] = {"router": router, "flow_method": moe.router_config.flow_method}
        try:
            extra.update(check_moe(moe, x.detach()))
            r_ms, _ = timed(lambda m=moe: m.router(x), warmup, iters)
            extra["router_fwd_ms"] = r_ms
            extra["host_syncs"] = sync_count(moe)
        except Exception as exc:
            extra["check_error"] = repr(exc)
            traceback.print_exc()
        record(f"maxscore/{router}", "moe", moe, extra)
        if router == "gshard":
            # Variants on the same layer: the eager (uncompiled) activation; the grouped path
            # (torch._grouped_mm) on the capacity routing instead of the padded bmm path.
            os.environ["MAXSCORE_TRITON"] = "0"
            record("maxscore/gshard compiled-swiglu", "moe", moe, {"router": router})
            experts_mod._COMPILE_FAILED = True
            record("maxscore/gshard eager-swiglu", "moe", moe, {"router": router})
            experts_mod._COMPILE_FAILED = False
            os.environ["MAXSCORE_TRITON"] = "1"
            record_experts_only(moe)
            moe.buffer_capacity = lambda result: None  # type: ignore[method-assign]
            record("maxscore/gshard grouped-path", "moe", moe, {"router": router})
            del moe.buffer_capacity
        if router == "maxscore":
            # Statistics are lazy (evaluated when read): this row reads them every step, as the
            # trainer's routing callback does, to show what they cost when used.
            inner = make_step(moe, x, grad, "moe")

            def stats_step(m: MoE = moe, inner: Callable[[], None] = inner) -> None:
                inner()
                _ = m.last_stats

            try:
                ms, _ = timed(stats_step, warmup, iters)
                rows.append(
                    {
                        "name": "maxscore/maxscore + stats read",
                        "ms": ms,
                        "tflops": flops / ms / 1e9,
                        "peak_mb": peak_extra_mb(stats_step),
                        "router": router,
                        "D": d,
                        "F": f,
                    }
                )
                log(f"  {'maxscore/maxscore + stats read':28s} {ms:8.3f} ms")
            except Exception:
                traceback.print_exc()
            moe.zero_grad(set_to_none=True)
            x.grad = None
        if router in ("gshard", "maxscore") and profile_dir:
            profile(moe, make_step(moe, x, grad, "moe"), f"{profile_dir}/profile_{router}_{d}.txt")
        del moe

    for impl in HF_IMPLS:
        try:
            block = hf_block(d, f, impl).to(dev, torch.bfloat16)
        except Exception as exc:
            rows.append({"name": f"hf-mixtral/{impl}", "error": repr(exc), "D": d, "F": f})
            continue
        record(f"hf-mixtral/{impl}", "dense", block)
        del block
    return rows


def table(rows: list[dict]) -> str:
    lines = []
    for d in sorted({r["D"] for r in rows}):
        sub = [r for r in rows if r["D"] == d]
        dense = next((r for r in sub if r["name"].startswith("dense") and "ms" in r), None)
        f = sub[0]["F"]
        lines += [
            f"\n### D = {d}, expert FFN {f}, T = {BATCH * SEQ}, E = {E}, k = {K}, bf16\n",
            "| layer | ms | TFLOP/s | x dense thr. | router fwd ms | peak MiB | x dense mem | "
            "bf16 rel err | host syncs |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sub:
            if "ms" not in r:
                lines.append(f"| {r['name']} | error: {r.get('error', '')[:80]} |||||||")
                continue
            ratio = dense["ms"] / r["ms"] if dense else float("nan")
            mem = r["peak_mb"] / dense["peak_mb"] if dense else float("nan")
            rt = f"{r['router_fwd_ms']:.3f}" if "router_fwd_ms" in r else ""
            err = f"{r['rel_err_vs_fp32']:.1e}" if "rel_err_vs_fp32" in r else ""
            lines.append(
                f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.0f} | {ratio:.2f} | {rt} | "
                f"{r['peak_mb']:.0f} | {mem:.2f} | {err} | {r.get('host_syncs', '')} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--only-d", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=32 * 512, help="T (default 16,384)")
    args = ap.parse_args()
    global DEVICE, BATCH
    DEVICE = torch.device(args.device)
    BATCH = args.tokens // SEQ
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    warmup, iters = (3, 5) if args.quick else (5, 20)

    def log(msg: str) -> None:
        print(msg, flush=True)

    import transformers

    from maxscore.routing.flow import FLOW_SOLVERS

    env = {
        "card": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "compile_activation": os.environ.get("MAXSCORE_COMPILE", "1") != "0",
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "flow_solvers": sorted(FLOW_SOLVERS),
        "tokens": BATCH * SEQ,
        "experts": E,
        "top_k": K,
        "dtype": "bf16 (router fp32)",
        "warmup": warmup,
        "iters": iters,
    }
    log(json.dumps(env))
    rows: list[dict] = []
    for d, f in SHAPES:
        if args.only_d and d != args.only_d:
            continue
        log(f"D={d} F={f}")
        rows += bench_shape(d, f, warmup, iters, log, args.out)
    md = "# MoE layer benchmark\n\n" + json.dumps(env, indent=1) + "\n" + table(rows) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_layer.json"), "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)
    with open(os.path.join(args.out, "moe_layer.md"), "w") as fh:
        fh.write(md)
    print(table(rows))


if __name__ == "__main__":
    main()
