"""Helpers for multi-process CPU tests: a free port and gloo process groups under ``mp.spawn``."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on now (for the rendezvous of spawned processes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launcher_env(rank: int, world: int, port: int) -> None:
    """The variables torchrun sets, for process ``rank`` of ``world`` on this machine."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )


def _run_in_group(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    import torch
    import torch.distributed as dist

    launcher_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_gloo(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes joined in a gloo process group.

    ``fn`` must be importable (a module-level function); an exception in any process fails the
    call with that process's traceback.
    """
    import torch.multiprocessing as mp

    mp.spawn(_run_in_group, args=(world, free_port(), fn, args), nprocs=world, join=True)


def _run_with_env(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    import torch

    launcher_env(rank, world, port)
    torch.set_num_threads(1)
    fn(rank, world, *args)


def spawn_launched(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes with torchrun's variables set and
    no process group yet (the Trainer / accelerate forms it, as under torchrun)."""
    import torch.multiprocessing as mp

    mp.spawn(_run_with_env, args=(world, free_port(), fn, args), nprocs=world, join=True)


def tiny_expert_parallel_model(router: str, num_experts: int, vocab: int, group_tokens: int) -> Any:
    """A 2-layer, 32-wide tiny Llama-MoE (seed 0) whose router, unless it is maxscore (which
    routes each sequence on its own), routes groups of ``group_tokens`` tokens: one process's
    micro-batch, so one process and several form the same routing groups."""
    import torch

    from maxscore.models import LlamaMoEForCausalLM
    from maxscore.models.presets import get_model_config

    groups = {"group": "tokens", "group_size": group_tokens}
    config = get_model_config(
        "tiny",
        router=router,
        router_config=groups if router != "maxscore" else None,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_experts=num_experts,
        vocab_size=vocab,
    )
    torch.manual_seed(0)
    return LlamaMoEForCausalLM(config)
