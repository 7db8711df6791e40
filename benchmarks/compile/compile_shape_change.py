"""Compiled Base layers through a change of batch size (a GPU check).

Trains the Base preset with compiled decoder layers (``compile_layers``) for a few optimizer
steps on random ids, changing the micro-batch between steps (128, 128, 60, 60, 128, 37 sequences
of 512 tokens: an epoch's partial last batch, then another shape). ``--dynamic auto`` is
torch.compile's default (a second shape makes the graph shape-generic), ``static`` what
``compile_layers`` passes by default (one graph per shape). Prints one line per step; a run that
finishes all six steps passes. ``README.md`` beside this script has the result.

``PYTHONPATH=src python3 benchmarks/compile/compile_shape_change.py --router gshard --dynamic auto``
"""

from __future__ import annotations

import argparse

import torch

from maxscore.training.config import TrainConfig
from maxscore.training.trainer import build_model, build_model_config

BATCHES = (128, 128, 60, 60, 128, 37)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--router", default="gshard")
    parser.add_argument("--dynamic", choices=("auto", "static"), default="static")
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    cfg = TrainConfig(model="base", router=args.router)
    model = build_model(build_model_config(cfg, vocab_size=32000), seed=0, on_gpu=True)
    model.compile_layers(dynamic=None if args.dynamic == "auto" else False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    for batch in BATCHES:
        ids = torch.randint(0, 32000, (batch, args.seq_len), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        print(f"{args.router} {args.dynamic} batch {batch}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
