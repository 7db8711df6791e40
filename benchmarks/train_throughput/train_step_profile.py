"""Where a Base-preset training step spends its time, outside the HF Trainer.

A bare training loop (bf16 autocast, fused AdamW, gradient clipping: what the Trainer does per
step, without its callbacks, logging and data loader) over random token ids, per router and
variant, so that the Trainer's own overhead and the effect of each speed lever can be read off
one table from one GPU run:

* ``eager``: the model as it is.
* ``compile``: every decoder layer compiled (``LlamaMoEForCausalLM.compile_layers``).
* ``compile-cg``: the same with ``mode="reduce-overhead"`` (each compiled layer replayed as a
  CUDA graph, removing the CPU's kernel-launch time).

``--precision fp8`` and ``--fused-loss`` apply the training options of the same names to every
variant, through the trainer's own code (``maxscore.training.model_build.apply_speed_options``:
torchao float8 dense linears under bf16 autocast; liger-kernel's fused LM head +
cross-entropy), with the trainer's checks (refused without a capable GPU or the library).

For each run: median step time over ``--steps`` timed steps (CUDA-synchronised per step),
tokens/s, MFU (same FLOP count as ``train_throughput.py``), peak memory, and, with
``--profile``, a torch.profiler table of the kernels that take the most GPU time plus the GPU's
busy fraction (sum of kernel times / wall time of the profiled steps: a value well below 1 means
the step is bound by the CPU launching kernels).

``PYTHONPATH=src python benchmarks/train_throughput/train_step_profile.py --routers dense,gshard,maxscore --variants eager,compile``
(add ``--precision fp8`` / ``--fused-loss`` for the speed options)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import H100_BF16_PEAK, flops_per_token


def build(
    router: str,
    model: str,
    overrides: dict[str, Any],
    precision: str = "bf16",
    fused_loss: bool = False,
) -> Any:
    """The model a training run builds, with its ``precision`` (``bf16`` or ``fp8``) and
    ``fused_loss`` options checked and applied as the trainer does (before any compilation)."""
    from maxscore.training import TrainConfig
    from maxscore.training.fused_loss import check_fused_loss
    from maxscore.training.model_build import apply_speed_options
    from maxscore.training.precision import resolve_precision
    from maxscore.training.trainer import build_model, build_model_config

    cfg = TrainConfig(
        model=model,
        router=router,
        model_overrides=overrides,
        precision=precision,  # type: ignore[arg-type]
        fused_loss=fused_loss,
    )
    resolved = resolve_precision(cfg.precision)
    check_fused_loss(cfg)
    model_config = build_model_config(cfg, vocab_size=32000)
    built = build_model(model_config, seed=0, on_gpu=True)
    apply_speed_options(built, cfg, resolved)
    return built


def step_fn(model: Any, optimizer: Any, batch: torch.Tensor):
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def profiled(step: Any, steps: int) -> tuple[Any, float]:
    """``steps`` calls of ``step`` under torch.profiler (CPU and CUDA): the profile and the
    wall seconds they took, CUDA-synchronised at both ends."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return prof, wall


def profile_table(step: Any, steps: int, rows: int) -> tuple[str, float]:
    prof, wall = profiled(step, steps)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events) / 1e6 / wall  # us -> s; overlaps are rare
    table = prof.key_averages().table(
        sort_by="device_time_total", row_limit=rows, max_name_column_width=70
    )
    return table, busy


def run(args: argparse.Namespace) -> None:
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.model_option)}
    for router in args.routers.split(","):
        for variant in args.variants.split(","):
            try:
                results.append(measure(router, variant, args, overrides, out))
            except Exception as err:  # keep the other rows of a precious GPU run
                print(f"!! {router}/{variant} failed: {type(err).__name__}: {err}", flush=True)
                import traceback

                traceback.print_exc()
            torch.cuda.empty_cache()
    write(results, args, out)


def measure(
    router: str, variant: str, args: argparse.Namespace, overrides: dict[str, Any], out: Path
) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(router, args.model, overrides, args.precision, args.fused_loss)
    model.train()
    if variant == "compile":
        model.compile_layers()
    elif variant == "compile-cg":  # CUDA graphs around each compiled layer (cudagraph trees)
        model.compile_layers(mode="reduce-overhead")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    vocab = model.config.vocab_size
    batch = torch.randint(0, vocab, (args.batch_size, args.seq_len), device="cuda")
    step = step_fn(model, optimizer, batch)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        s0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s0)
    med = statistics.median(times)
    fpt, _ = flops_per_token(model, args.seq_len)
    tps = args.batch_size * args.seq_len / med
    row: dict[str, Any] = {
        "router": router,
        "variant": variant,
        "precision": args.precision,
        "fused_loss": args.fused_loss,
        "batch_size": args.batch_size,
        "step_ms": 1000 * med,
        "tokens_per_s": tps,
        "mfu": tps * fpt / H100_BF16_PEAK,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "warmup_s": warm_s,
    }
    if args.profile:
        table, busy = profile_table(step, 3, args.rows)
        row["gpu_busy"] = busy
        with (out / f"profiles_b{args.batch_size}.txt").open("a") as handle:
            handle.write(f"== {router} / {variant}, batch {args.batch_size}, busy {busy:.2f}\n")
            handle.write(table + "\n\n")
    print(json.dumps(row), flush=True)
    return row


def write(results: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    tag = args.tag or f"b{args.batch_size}"
    (out / f"train_step_profile_{tag}.json").write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "model": args.model,
                "seq_len": args.seq_len,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(
        f"{'router':10} {'variant':8} {'batch':>5} {'step ms':>8} {'tok/s':>9} {'MFU':>6} {'GiB':>5}"
    )
    for r in results:
        print(
            f"{r['router']:10} {r['variant']:8} {r['batch_size']:5d} {r['step_ms']:8.1f} "
            f"{r['tokens_per_s']:9.0f} {r['mfu']:6.1%} {r['peak_gib']:5.1f} "
            f"{r.get('gpu_busy', float('nan')):.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", default="dense,gshard,maxscore")
    parser.add_argument("--variants", default="eager,compile")
    parser.add_argument("--model", default="base")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--tag", default="")
    parser.add_argument("--model-option", action="append", default=[], help="KEY=VALUE")
    parser.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default="bf16",
        help="bf16 autocast, or fp8: bf16 autocast + torchao float8 dense linears (sm89+)",
    )
    parser.add_argument(
        "--fused-loss",
        action="store_true",
        help="liger-kernel's fused LM head + cross-entropy (TrainConfig.fused_loss)",
    )
    parser.add_argument("--output", default="/tmp/out")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
