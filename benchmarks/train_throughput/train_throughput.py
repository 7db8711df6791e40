"""Training throughput of the Base preset per router: tokens/s, MFU and peak memory.

``python benchmarks/train_throughput/train_throughput.py throughput --routers dense,gshard,dropless,maxscore``

Trains the Base preset (bf16, seq 512) for ``--steps`` optimizer steps per router through the
real ``maxscore.training.train`` path (HF Trainer, AdamW, WSD) on the embedded corpus, and
measures steady-state tokens/s (steps after ``--warmup`` only, CUDA-synchronised), MFU and peak
memory. Results go to ``--output`` (default ``$OUT`` or ``.``): ``train_throughput[_TAG].json``
and ``.md``; ``--compile``, ``--grad-accum``, ``--batch-size`` set the variant,
``--profile-steps N`` writes a host + GPU profile of N steps (``trainer_profile_<router>.txt``
and, per kernel, ``.json``).

MFU = achieved model FLOP/s / peak, with model FLOPs per token (PaLM appendix B convention)
``6 * N_active + 12 * L * H * Q * T``: ``N_active`` the activated parameters that take part in
matrix products (everything except the input embedding; a routed expert counts k/e times),
``L`` layers, ``H`` heads, ``Q`` head dim, ``T`` sequence length (attention counted as
non-causal, as PaLM and Megatron do). Peak: H100 SXM bf16 dense, 989 TFLOP/s. Router and
dispatch work is not counted (it is overhead, as it should be).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import H100_BF16_PEAK, SDPA_BACKENDS, flops_per_token, step_timer, timing_train_config


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with a JSON value (``moves=4``, ``num_hidden_layers=2``)."""
    key, sep, value = text.partition("=")
    try:
        if not sep or not key:
            raise ValueError
        return key, json.loads(value)
    except ValueError:
        sys.exit(f"option {text!r} is not KEY=VALUE with a JSON value (e.g. moves=4)")


def _sdpa_backends(first: str) -> contextlib.AbstractContextManager:
    """``--sdpa-backend``: try this SDPA backend first (``default`` leaves PyTorch's order)."""
    if first == "default":
        return contextlib.nullcontext()
    backends = [SDPA_BACKENDS[first], *(b for n, b in SDPA_BACKENDS.items() if n != first)]
    return sdpa_kernel([*backends, SDPBackend.MATH], set_priority=True)


def run_throughput(args: argparse.Namespace) -> None:
    from transformers import TrainerCallback

    from maxscore.training import train

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"

    class StepProfiler(TrainerCallback):
        """torch.profiler + cProfile over optimizer steps warmup+1 .. warmup+n (``--profile-steps``):
        where the Trainer path's host time goes, and the GPU's busy fraction."""

        def __init__(self, warmup: int, steps: int, path: Path, shapes: bool) -> None:
            self.first, self.last, self.path = warmup, warmup + steps, path
            self.shapes = shapes
            self.prof: Any = None
            self.py: Any = None
            self.t0 = 0.0

        def on_step_end(self, a: Any, state: Any, control: Any, **kw: Any) -> Any:
            import cProfile

            from torch.profiler import ProfilerActivity, profile

            if state.global_step == self.first:
                _sync()
                self.prof = profile(
                    activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                    record_shapes=self.shapes,
                )
                self.prof.__enter__()
                self.py = cProfile.Profile()
                self.py.enable()
                self.t0 = time.perf_counter()
            elif state.global_step == self.last and self.prof is not None:
                _sync()
                wall = time.perf_counter() - self.t0
                self.py.disable()
                self.prof.__exit__(None, None, None)
                import io
                import pstats

                cuda = torch.autograd.DeviceType.CUDA
                busy = sum(e.device_time for e in self.prof.events() if e.device_type == cuda)
                text = io.StringIO()
                pstats.Stats(self.py, stream=text).sort_stats("cumulative").print_stats(45)
                averages = self.prof.key_averages()
                host = averages.table(
                    sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
                )
                gpu = averages.table(
                    sort_by="self_device_time_total", row_limit=60, max_name_column_width=90
                )
                by_shape = ""
                if self.shapes:  # which tensors the top kernels touch (sizes and dtypes)
                    by_shape = self.prof.key_averages(group_by_input_shape=True).table(
                        sort_by="self_device_time_total", row_limit=40, max_name_column_width=40
                    )
                # Every kernel's GPU time, for diffing two routers' steps (not only the top 60).
                kernels = sorted(
                    (
                        {
                            "name": e.key,
                            "gpu_us": e.self_device_time_total / (self.last - self.first),
                            "calls": e.count / (self.last - self.first),
                        }
                        for e in averages
                        if e.self_device_time_total > 0
                    ),
                    key=lambda row: -row["gpu_us"],
                )
                self.path.with_suffix(".json").write_text(json.dumps(kernels, indent=1))
                self.path.write_text(
                    f"wall {wall:.3f} s over {self.last - self.first} optimizer steps; GPU busy "
                    f"{busy / 1e6 / wall:.2f}\n\n== by GPU time\n{gpu}\n\n== by host time\n"
                    f"{host}\n\n{text.getvalue()}\n\n== by GPU time and input shapes\n{by_shape}"
                )
            return control

    for router in args.routers.split(","):
        model_preset = args.model  # router "dense" makes every MLP a dense SwiGLU
        cfg = timing_train_config(
            model=model_preset,
            model_overrides={k: v for k, v in (_parse_option(o) for o in args.model_option)},
            router=router,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            grad_accum=args.grad_accum,
            compile=args.compile,
            compile_mode=args.compile_mode,
            max_steps=args.steps,
            gradient_checkpointing=args.gradient_checkpointing,
            logging_steps=args.log_every,
            max_eval_blocks=4,
            output_dir=str(Path(args.runs_dir) / router),
        )
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        timer = step_timer(args.warmup)
        print(f"== {router} ({model_preset})", flush=True)
        callbacks: list[Any] = [timer]
        if args.profile_steps:
            path = out / f"trainer_profile_{router}.txt"
            callbacks.append(
                StepProfiler(args.warmup, args.profile_steps, path, args.profile_shapes)
            )
        with _sdpa_backends(args.sdpa_backend):
            result = train(cfg, callbacks=callbacks)
        fpt, n_active = flops_per_token(timer.model, args.seq_len)
        tokens = timer.steps * args.batch_size * args.grad_accum * args.seq_len
        seconds = timer.t1 - timer.t0
        tps = tokens / seconds
        rc = timer.model.config.router_config.to_dict()
        row = {
            "router": router,
            "router_setup": {
                k: rc.get(k)
                for k in ("operator", "strategy", "capacity_factor", "group", "flow_method")
            },
            "model": model_preset,
            "model_overrides": cfg.model_overrides or None,
            "activated_matmul_params": n_active,
            "flops_per_token": fpt,
            "timed_steps": timer.steps,
            "step_ms": 1000 * seconds / timer.steps,
            "tokens_per_s": tps,
            "tflops": tps * fpt / 1e12,
            "mfu": tps * fpt / H100_BF16_PEAK,
            "peak_memory_gib": result.peak_memory_gb,
            "final_train_loss": result.train_loss,
            "eval_loss": result.eval_loss,
            "dropped": result.routing.get("dropped"),
            "load_imbalance": result.routing.get("load_imbalance"),
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        del timer.model, result
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    gshard = next((r for r in results if r["router"] == "gshard"), None)
    for row in results:
        row["vs_gshard"] = row["tokens_per_s"] / gshard["tokens_per_s"] if gshard else None
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seq_len": args.seq_len,
        "micro_batch": args.batch_size,
        "grad_accum": args.grad_accum,
        "compile": args.compile,
        "compile_mode": args.compile_mode if args.compile else None,
        "steps": args.steps,
        "warmup_steps_excluded": args.warmup,
        "dtype": "bf16 autocast, fp32 master weights (HF Trainer bf16=True)",
        "gradient_checkpointing": args.gradient_checkpointing,
        "peak_flops": H100_BF16_PEAK,
        "sdpa_backend_first": args.sdpa_backend,
    }
    tag = f"_{args.tag}" if args.tag else ""
    (out / f"train_throughput{tag}.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=2) + "\n"
    )
    lines = [
        f"# Training throughput, {args.model} preset",
        "",
        f"{meta['device']}, torch {meta['torch']}, {meta['date']}. bf16, seq {args.seq_len}, "
        f"micro-batch {args.batch_size} x {args.grad_accum} accumulation "
        f"({args.batch_size * args.grad_accum * args.seq_len} tokens per optimizer step), "
        + (
            f"torch.compile (mode {args.compile_mode}) of every decoder layer and the loss, "
            if args.compile
            else "eager, "
        )
        + f"{args.steps} steps of which the first {args.warmup} are excluded from timing; HF Trainer "
        "with AdamW through `maxscore.training.train`. MFU: (6·N_active + 12·L·H·Q·T) FLOPs per "
        "token over 989 TFLOP/s (H100 bf16 dense).",
        "",
        "| router | model | step ms | tokens/s | vs gshard | TFLOP/s | MFU | peak GiB | dropped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        drop = "-" if r.get("dropped") is None else f"{r['dropped']:.1%}"
        ratio = "-" if r["vs_gshard"] is None else f"{r['vs_gshard']:.3f}"
        lines.append(
            f"| {r['router']} | {r['model']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{ratio} | {r['tflops']:.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} | {drop} |"
        )
    lines += ["", "Router setups (routing group = where capacity is defined):", ""]
    for r in results:
        setup = ", ".join(f"{k} {v}" for k, v in r["router_setup"].items() if v is not None)
        lines.append(f"- {r['router']}: {setup}")
    (out / f"train_throughput{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("throughput", help="tokens/s, MFU, peak memory per router (GPU)")
    t.add_argument("--routers", default="dense,gshard,dropless,maxscore")
    t.add_argument("--model", default="base")
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--warmup", type=int, default=20)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--compile", action="store_true", help="TrainConfig.compile (compile_layers)")
    t.add_argument("--compile-mode", default="default", help="TrainConfig.compile_mode")
    t.add_argument("--gradient-checkpointing", action="store_true")
    t.add_argument("--model-option", action="append", default=[], help="KEY=VALUE (dry runs)")
    t.add_argument("--allow-cpu", action="store_true", help="dry run without a GPU")
    t.add_argument(
        "--sdpa-backend",
        choices=("default", *SDPA_BACKENDS),
        default="default",
        help="the attention backend PyTorch tries first",
    )
    t.add_argument("--output", default=os.environ.get("OUT", "."))
    t.add_argument("--tag", default="", help="suffix of the result files")
    t.add_argument(
        "--profile-steps", type=int, default=0, help="profile N steps after warmup (host + GPU)"
    )
    t.add_argument(
        "--profile-shapes", action="store_true", help="with --profile-steps: input shapes too"
    )
    t.add_argument("--runs-dir", default="/tmp/maxscore-bench-runs", help="run directories")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("throughput mode needs a CUDA GPU (or --allow-cpu for a dry run)")
    run_throughput(args)


if __name__ == "__main__":
    main()
