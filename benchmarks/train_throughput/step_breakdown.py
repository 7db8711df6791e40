"""Where a training step's GPU time goes, by part of the model, per preset and router.

A bare eager training step (bf16 autocast, fused AdamW, gradient clipping; the model of
``train_step_profile.build``) with CUDA events recorded at the boundaries of each part, in the
forward pass (module hooks) and in the backward pass (full backward hooks: the pre-hook fires
when the gradient of a module's output arrives, the hook when its input's gradient is computed).
The events need no host synchronisation, so the step runs as it would unmeasured; the times are
read once after the profiled steps. Parts:

* ``attention``: each layer's ``self_attn`` (q / k / v / o projections, RoPE, the kernel);
* ``norms``: the RMSNorms;
* ``router``: the MoE router's forward (scores, operator, the assignment strategy and its
  solver, losses); its backward (the gate's and the operator's) is counted in the MoE layer's
  rest below, since the router returns no tensor that a backward hook could bracket;
* ``expert_gemms``: the experts' matrix products and SwiGLU (``padded_rows`` / ``grouped_rows``);
* ``dispatch_combine``: the rest of the MoE layer (slot positions, gathering rows, weighting and
  scattering them back, padding to whole groups, the router's backward);
* ``shared_experts`` and ``dense_mlp`` (DeepSeek's shared expert, a dense model's MLP);
* ``lm_head_loss``: the LM head and the cross-entropy, forward and backward;
* ``optimizer``: gradient clipping, fused AdamW and zeroing the gradients;
* ``other``: what the step's wall time holds besides (embeddings, residual adds, the autograd
  engine's own kernels, and the GPU idle while the CPU launches kernels).

The parts are measured eager: hooks cannot bracket parts inside a compiled layer. The compiled
step of the same model (every decoder layer and the loss compiled, as ``--compile`` trains) is
timed beside it (``compiled_ms``) and profiled: its kernels' time by class of kernel name
(matrix products, attention kernels, Triton-fused element-wise kernels, sorts and scans of the
routing, optimizer, copies) and the time the GPU waits for the CPU (``gpu_idle``). Random token
ids, after ``--warmup`` steps.

``PYTHONPATH=src python benchmarks/train_throughput/step_breakdown.py \\
    --runs base:gshard,base:maxscore,dense-base:dense --output /tmp/out``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from train_step_profile import build, profiled, step_fn

from common import H100_BF16_PEAK, flops_per_token, timed

PARTS = (
    "attention",
    "norms",
    "router",
    "expert_gemms",
    "dispatch_combine",
    "shared_experts",
    "dense_mlp",
    "lm_head_loss",
    "optimizer",
    "other",
)


class _Scope(nn.Module):
    """A module around a plain function, so that module hooks can bracket it."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class EventLog:
    """CUDA events at part boundaries: ``spans[part]`` holds (start, end) event pairs."""

    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[Any, Any]]] = defaultdict(list)
        self.open: dict[tuple[str, int, str], Any] = {}
        self.enabled = False

    def mark(self, part: str, key: int, phase: str, begin: bool) -> None:
        if not self.enabled:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if begin:
            self.open[(part, key, phase)] = event
        else:
            start = self.open.pop((part, key, phase), None)
            if start is not None:
                self.spans[f"{part}:{phase}"].append((start, event))

    def watch(self, module: nn.Module, part: str, backward: bool = True) -> None:
        key = id(module)
        module.register_forward_pre_hook(lambda *_: self.mark(part, key, "fwd", True))
        module.register_forward_hook(lambda *_: self.mark(part, key, "fwd", False))
        if not backward:
            return
        module.register_full_backward_pre_hook(lambda *_: self.mark(part, key, "bwd", True))
        module.register_full_backward_hook(lambda *_: self.mark(part, key, "bwd", False))

    def totals_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {
            name: sum(a.elapsed_time(b) for a, b in pairs) for name, pairs in self.spans.items()
        }


def instrument(model: nn.Module, log: EventLog) -> None:
    """Hooks on every part of ``model`` (see the module docstring)."""
    from maxscore.moe.experts import DenseMLP, SwiGLUExperts
    from maxscore.moe.layer import MoE

    for name, module in list(model.named_modules()):
        if name.endswith("self_attn"):
            log.watch(module, "attention")
        elif name.endswith("layernorm") or name.endswith(".norm"):
            log.watch(module, "norms")
        elif isinstance(module, MoE):
            log.watch(module, "moe")
            log.watch(module.router, "router", backward=False)
            if module.shared_experts is not None:
                log.watch(module.shared_experts, "shared_experts")
        elif isinstance(module, SwiGLUExperts):
            # The matrix products are methods: route them through hooked scopes (an instance
            # attribute, which shadows the class's method; not registered as a submodule).
            for method in ("padded_rows", "grouped_rows"):
                scope = _Scope(getattr(module, method))
                log.watch(scope, "expert_gemms")
                object.__setattr__(module, method, scope)
        elif isinstance(module, DenseMLP) and name.endswith("mlp"):
            log.watch(module, "dense_mlp")
    log.watch(model.lm_head, "lm_head")


def measure(preset: str, router: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(router, preset, {})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = torch.randint(
        0, model.config.vocab_size, (args.batch_size, args.seq_len), device="cuda"
    )
    log = EventLog()
    instrument(model, log)
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        start, after_forward, after_backward, end = (
            torch.cuda.Event(enable_timing=True) for _ in range(4)
        )
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        after_forward.record()
        loss.backward()
        after_backward.record()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        if log.enabled:
            log.spans["step"].append((start, end))
            log.spans["optimizer"].append((after_backward, end))
            log.spans["forward"].append((start, after_forward))
            log.spans["backward"].append((after_forward, after_backward))

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    log.enabled = True
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - t0) / args.steps
    log.enabled = False
    raw = {name: total / args.steps for name, total in log.totals_ms().items()}
    parts = split_parts(raw, log, args.steps)
    fpt, _ = flops_per_token(model, args.seq_len)
    peak = torch.cuda.max_memory_allocated() / 2**30

    # The same model, compiled per layer as the trainer's --compile does, timed without hooks.
    compiled_ms = None
    kernels: dict[str, float] = {}
    if args.compiled:
        del optimizer, log, model
        torch.cuda.empty_cache()
        model = build(router, preset, {})
        model.train()
        model.compile_layers()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        plain = step_fn(model, optimizer, batch)
        compiled_ms, _ = timed(plain, args.warmup, args.steps)
        kernels = kernel_classes(plain, 3)
    tokens = args.batch_size * args.seq_len
    row = {
        "preset": preset,
        "router": router,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "eager_step_ms": parts["step"],
        "eager_wall_ms": wall_ms,
        "eager_mfu": tokens / (parts["step"] / 1000) * fpt / H100_BF16_PEAK,
        "compiled_ms": compiled_ms,
        "compiled_mfu": None
        if compiled_ms is None
        else tokens / (compiled_ms / 1000) * fpt / H100_BF16_PEAK,
        "peak_gib_eager": peak,
        "parts_ms": {part: parts[part] for part in PARTS},
        "compiled_kernels_ms": kernels,
        "raw_ms": raw,
    }
    print(json.dumps(row), flush=True)
    return row


#: Kernel-name patterns of a compiled step's GPU kernels, first match wins (lower-case).
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "grouped_mm", "cublas", "splitk")),
    ("optimizer", ("multi_tensor_apply", "adam", "foreach")),
    ("routing_sort_scan", ("sort", "radix", "scan", "topk", "cub::", "auction", "flow")),
    ("triton_fused", ("triton",)),
    ("copy_fill_index", ("copy", "fill", "memcpy", "memset", "index", "scatter", "gather", "cat")),
)


def kernel_classes(step: Any, steps: int) -> dict[str, float]:
    """Per-step milliseconds of the compiled step's kernels by class (:data:`KERNEL_CLASSES`),
    ``other_kernels`` for the rest and ``gpu_idle`` for the wall time no kernel ran in."""
    prof, wall_s = profiled(step, steps)
    wall_ms = 1000 * wall_s
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        label = next(
            (cls for cls, keys in KERNEL_CLASSES if any(key in name for key in keys)),
            "other_kernels",
        )
        totals[label] += event.device_time / 1000  # us -> ms
    busy = sum(totals.values())
    totals["gpu_idle"] = max(0.0, wall_ms - busy)
    return {label: ms / steps for label, ms in sorted(totals.items())}


def split_parts(raw: dict[str, float], log: EventLog, steps: int) -> dict[str, float]:
    """Per-step milliseconds of each part; nested parts subtracted from their container."""

    def both(part: str) -> float:
        return raw.get(f"{part}:fwd", 0.0) + raw.get(f"{part}:bwd", 0.0)

    step = raw["step"]
    parts = {
        "attention": both("attention"),
        "norms": both("norms"),
        "router": both("router"),
        "expert_gemms": both("expert_gemms"),
        "shared_experts": both("shared_experts"),
        "dense_mlp": both("dense_mlp"),
        "optimizer": raw["optimizer"],
    }
    parts["dispatch_combine"] = max(
        0.0, both("moe") - parts["router"] - parts["expert_gemms"] - parts["shared_experts"]
    )
    # LM head + loss: from the LM head's forward to the end of the forward pass, and from the
    # start of the backward pass to the end of the LM head's backward.
    lm_fwd = _start_to_end_ms(log, "lm_head:fwd", "forward", steps)
    lm_bwd = _start_to_end_ms(log, "backward", "lm_head:bwd", steps)
    parts["lm_head_loss"] = lm_fwd + lm_bwd
    parts["other"] = max(0.0, step - sum(parts.values()))
    parts["step"] = step
    return parts


def _start_to_end_ms(log: EventLog, first: str, last: str, steps: int) -> float:
    """Per step, from the start of each ``first`` span to the end of its step's ``last`` span."""
    pairs = zip(log.spans.get(first, []), log.spans.get(last, []))
    return sum(a.elapsed_time(b) for (a, _), (_, b) in pairs) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="base:gshard,base:maxscore", help="PRESET:ROUTER,...")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compiled", dest="compiled", action="store_false")
    parser.add_argument("--output", default="/tmp/out")
    parser.add_argument("--tag", default="step_breakdown")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.runs.split(","):
        preset, router = spec.split(":")
        try:
            rows.append(measure(preset, router, args))
        except Exception as err:  # keep the other rows of a device call
            print(f"!! {spec} failed: {type(err).__name__}: {err}", flush=True)
        torch.cuda.empty_cache()
        (out / f"{args.tag}.json").write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                indent=2,
            )
            + "\n"
        )
    header = f"{'preset':14} {'router':9} {'eager':>6} {'comp':>6} " + " ".join(
        f"{p[:8]:>8}" for p in PARTS
    )
    print(header)
    for r in rows:
        comp = f"{r['compiled_ms']:6.1f}" if r["compiled_ms"] else "     -"
        print(
            f"{r['preset']:14} {r['router']:9} {r['eager_step_ms']:6.1f} {comp} "
            + " ".join(f"{r['parts_ms'][p]:8.1f}" for p in PARTS)
        )
    for r in rows:
        if r["compiled_kernels_ms"]:
            classes = ", ".join(f"{k} {v:.1f}" for k, v in r["compiled_kernels_ms"].items())
            print(f"compiled {r['preset']}/{r['router']}: {classes}")


if __name__ == "__main__":
    main()
