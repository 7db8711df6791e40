"""Processes and DeepSpeed: which process this is, the model inside its wrappers, ZeRO set-up.

A run is launched by torchrun / accelerate / the deepspeed launcher (one process per GPU) or
without a launcher (one process). These helpers read what the launcher set, find the model
inside DDP / DeepSpeed / compile wrappers, and prepare what DeepSpeed needs: its config file,
launcher variables for a run started without a launcher, and ZeRO-3 leaf modules.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

from maxscore.moe import MoE
from maxscore.training.config import ConfigError

__all__ = [
    "DEEPSPEED_CONFIGS",
    "check_deepspeed_installed",
    "deepspeed_config_path",
    "is_main_process",
    "mark_zero3_leaf_modules",
    "single_process_launcher_env",
    "unwrap",
    "world_size",
    "zero_stage",
]

#: Shipped DeepSpeed configs, by short name.
DEEPSPEED_CONFIGS = {
    "zero2": Path(__file__).resolve().parent.parent / "configs" / "deepspeed_zero2.json",
    "zero3": Path(__file__).resolve().parent.parent / "configs" / "deepspeed_zero3.json",
}


def world_size() -> int:
    """Processes of this run (torchrun / accelerate set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def unwrap(model: Any) -> Any:
    """The model inside DDP / DeepSpeed / compile wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(model, "_orig_mod", model)


def deepspeed_config_path(name: str) -> str:
    """The path of a DeepSpeed config: a shipped one by name, or a JSON file."""
    if name in DEEPSPEED_CONFIGS:
        return str(DEEPSPEED_CONFIGS[name])
    if not Path(name).is_file():
        raise ConfigError(
            f"DeepSpeed config {name!r} is neither a shipped one ({sorted(DEEPSPEED_CONFIGS)}) "
            "nor a file"
        )
    return name


#: What to do when ``--deepspeed`` is given without the package.
DEEPSPEED_MISSING = (
    "--deepspeed needs the deepspeed package, which is not installed: pip install "
    "'maxscore[deepspeed]' (or pip install deepspeed; it builds its ops on a machine with the "
    "CUDA toolkit), or train without --deepspeed"
)


def check_deepspeed_installed() -> None:
    """Refuse ``--deepspeed`` without the package, before anything is written (the Trainer would
    fail later with ``PackageNotFoundError`` from inside accelerate)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(DEEPSPEED_MISSING)


def zero_stage(deepspeed: str) -> int | None:
    """The ZeRO stage of a DeepSpeed config (shipped name or JSON path)."""
    config = json.loads(Path(deepspeed_config_path(deepspeed)).read_text())
    return config.get("zero_optimization", {}).get("stage")


def mark_zero3_leaf_modules(model: Any, deepspeed: str | None) -> None:
    """Make ZeRO-3 gather each MoE block's parameters as a whole (``set_z3_leaf_modules``).

    ZeRO-3 fetches parameters through hooks on the modules that run; inside an MoE block which
    experts run depends on the data, so those hooks would differ between processes and hang.
    """
    if deepspeed is None or zero_stage(deepspeed) != 3:
        return
    try:  # an optional package, needed only under ZeRO-3
        from deepspeed.utils import set_z3_leaf_modules
    except ImportError as err:
        raise ConfigError(DEEPSPEED_MISSING) from err
    set_z3_leaf_modules(model, [MoE])


def single_process_launcher_env() -> None:
    """Launcher variables for a DeepSpeed run started without a launcher (one process).

    ``deepspeed.init_distributed`` needs RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; without
    them it falls back to MPI discovery, which fails without ``mpi4py`` and an MPI launch. A
    plain ``maxscore train --deepspeed zero2`` (no torchrun / deepspeed launcher: none of RANK,
    LOCAL_RANK, WORLD_SIZE set) is therefore given the environment of a one-process launch;
    MASTER_ADDR / MASTER_PORT already set are kept, else 127.0.0.1 and a free local port.
    """
    if any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
