"""Whether a run's checkpoints fit on its disk: a warning at the start instead of a full disk at
the first save, possibly hours later.

A checkpoint holds the model's weights (safetensors, in their dtype) and AdamW's state (``torch.save``
of two moments per trainable parameter, in the parameter's dtype): about 12 bytes a parameter for
an fp32 model, 9.1 GB for the 757M-parameter Base MoE. While a new checkpoint is written the kept
ones are still on disk (they are deleted only after it is complete, ``checkpoint.py``), so the disk
must hold ``--save-total-limit`` of them plus the one being written.

The estimate is the one process's view of a plain or DDP run; runs whose checkpoints are sharded
or partial (expert parallelism, FSDP, DeepSpeed, LoRA's adapters) are not estimated.
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import nn

from maxscore import write_errors

__all__ = ["checkpoint_bytes", "checkpoints_at_once", "disk_space_warning"]

#: AdamW keeps two moments (exp_avg, exp_avg_sq) per trainable parameter.
_ADAM_MOMENTS = 2


def checkpoint_bytes(model: nn.Module) -> int:
    """Bytes of one checkpoint of ``model``: its weights plus AdamW's two moments for every
    trainable parameter (files' headers and the small trainer states left out)."""
    return sum(
        p.numel() * p.element_size() * (1 + _ADAM_MOMENTS * p.requires_grad)
        for p in model.parameters()
    )


def checkpoints_at_once(total_steps: int, save_steps: int, save_final: bool, keep: int) -> int:
    """The most checkpoints on disk at one time: those kept (``keep``; ``<= 0`` keeps all) plus
    the one being written, never more than the run writes."""
    saves = total_steps // save_steps if save_steps > 0 else 0
    if save_final and (save_steps <= 0 or total_steps % save_steps):
        saves += 1
    return saves if keep <= 0 else min(saves, keep + 1)


def disk_space_warning(
    run_dir: Path,
    model: nn.Module,
    *,
    total_steps: int,
    save_steps: int,
    save_final: bool,
    keep: int,
) -> str | None:
    """A one-line warning when the checkpoints the run will hold at once exceed the free space
    of ``run_dir``'s file system, else ``None``."""
    count = checkpoints_at_once(total_steps, save_steps, save_final, keep)
    if count == 0:
        return None
    each = checkpoint_bytes(model)
    free = write_errors.free_bytes(Path(run_dir))
    if free is None or free >= count * each:
        return None
    if keep <= 0:
        why = "every checkpoint is kept"
    elif count == keep + 1:
        why = f"--save-total-limit {keep} plus the one being written"
    else:
        why = "every checkpoint it writes"
    return (
        f"maxscore: warning: a checkpoint of this model takes about {_gb(each)} and the run "
        f"holds up to {count} at once ({why}): {_gb(count * each)}, but the disk of {run_dir} "
        f"has {_gb(free)} free. Free some space, lower --save-total-limit or checkpoint less "
        "often (--save-steps, --no-save-final), or a save will fail on a full disk (the "
        "checkpoints before it stay intact)."
    )


def _gb(size: float) -> str:
    return f"{math.ceil(size / 1e8) / 10:.1f} GB"
