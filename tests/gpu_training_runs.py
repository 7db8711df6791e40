"""The training runs of the two-GPU tests (``tests/test_expert_parallel_gpu.py``), as a script.

One GPU, or one process per GPU under torchrun (NCCL; the Trainer's accelerate state binds each
process to ``cuda:LOCAL_RANK``)::

    python tests/gpu_training_runs.py OUT --routers gshard,dropless,maxscore --batch-size 16
    torchrun --nproc-per-node 2 tests/gpu_training_runs.py OUT --routers gshard,dropless,maxscore \\
        --batch-size 8 --expert-parallel 2 --ddp-reference

Each router trains into ``OUT/<router>`` one after the other in the same processes (as
``maxscore compare`` does), with the settings of :func:`run_config`: the tiny preset in fp32, seq
128, 100 steps, a checkpoint every 50, every step logged. ``--ddp-reference`` adds a plain DDP
run of maxscore (no expert parallelism) in ``OUT/ddp``; ``--deepspeed`` runs under DeepSpeed;
``--stop-after N`` ends training after step N with the schedule of the full run;
``--trace-steps N`` records every MoE layer's routing decisions of the first N steps
(``tests/routing_trace.py``: ``OUT/<router>/routing/routing_rank<R>.pt``); ``--perturb EPS``
multiplies the initial embeddings by ``1 + EPS * noise`` (the same noise on every process), a
rounding-sized change of the start for the divergence controls; ``--steps`` and ``--seq-len``
shorten the run.

Capacity routers route each process's micro-batch as a routing group (``group="tokens"``,
``group_size`` = the tokens of a micro-batch of ``--group-batch`` sequences), so one GPU with
twice the micro-batch forms the same groups as two GPUs; maxscore routes per sequence anyway.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

#: MAXSCORE_GPU_RUNS_SMALL=1: a 1-layer model of width 32 for 10 steps, to try the harness on
#: the CPU (the GPU tests then run there too; tests/test_expert_parallel_gpu.py).
SMALL = bool(os.environ.get("MAXSCORE_GPU_RUNS_SMALL"))
SMALL_MODEL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
SEQ_LEN = 128
STEPS = 10 if SMALL else 100


def run_config(out: Path, router: str, args: argparse.Namespace, **overrides: Any) -> Any:
    """The :class:`~maxscore.training.TrainConfig` of one run of the GPU tests."""
    from maxscore.training import TrainConfig

    groups = None
    if router != "maxscore":
        groups = {"group": "tokens", "group_size": args.group_batch * args.seq_len}
    settings: dict[str, Any] = {
        "model": "tiny",
        "model_overrides": dict(SMALL_MODEL) if SMALL else {},
        "router": router,
        "router_overrides": groups or {},
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "max_steps": args.steps,
        "logging_steps": 1,
        "eval_steps": 0,
        "save_steps": args.save_steps,
        "save_final": args.save_steps > 0,
        "max_eval_blocks": 16,  # full evaluation batches: whole routing groups
        # fp32 (TF32 matrix products): the comparison of 1 and 2 GPUs is then rounding-level at
        # step 1; bf16's rounding of different GEMM shapes would hide what is being tested.
        "precision": "fp32",
        "expert_parallel": args.expert_parallel,
        "deepspeed": args.deepspeed,
        "resume": args.resume,
        "report_to": "none",
        "quiet": True,
        "output_dir": str(out / router),
    }
    return TrainConfig(**{**settings, **overrides})


def _stop_after(step: int) -> Any:
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if state.global_step >= step:
                control.should_training_stop = True
            return control

    return StopAfter()


def _perturb_embeddings(eps: float) -> Any:
    """Multiply the initial input embeddings by ``1 + eps * N(0, 1)`` before the first step."""
    import torch
    from transformers import TrainerCallback

    class Perturb(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            weight = kw["model"].get_input_embeddings().weight
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                weight.mul_(1 + eps * noise.to(weight.device, weight.dtype))

    return Perturb()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--routers", default="gshard,dropless,maxscore")
    parser.add_argument("--batch-size", type=int, required=True, help="per process")
    parser.add_argument("--group-batch", type=int, default=8, help="sequences per routing group")
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--deepspeed", default=None)
    parser.add_argument("--save-steps", type=int, default=STEPS // 2)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--ddp-reference", action="store_true")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--trace-steps", type=int, default=0)
    parser.add_argument("--trace-logits", type=int, default=1, help="steps whose logits are kept")
    parser.add_argument("--perturb", type=float, default=0.0)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pid_dir = os.environ.get("MAXSCORE_PID_DIR")
    if pid_dir:  # the tests kill every worker of a run with these
        rank = os.environ.get("RANK", "0")
        (Path(pid_dir) / f"rank{rank}.pid").write_text(str(os.getpid()))
    import torch

    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # before any CUDA work

    from maxscore.training import train
    from routing_trace import RoutingTrace

    callbacks = [_stop_after(args.stop_after)] if args.stop_after else []
    if args.perturb:
        callbacks.append(_perturb_embeddings(args.perturb))

    def run(config: Any) -> None:
        trace = []
        if args.trace_steps:
            folder = Path(config.output_dir) / "routing"
            trace = [RoutingTrace(folder, args.trace_steps, args.trace_logits)]
        train(config, callbacks=[*callbacks, *trace])

    for router in args.routers.split(","):
        run(run_config(args.out, router, args))
    if args.ddp_reference:
        run(
            run_config(
                args.out, "maxscore", args, expert_parallel=1, output_dir=str(args.out / "ddp")
            )
        )


if __name__ == "__main__":
    main()
