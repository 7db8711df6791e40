"""Which SDPA backend is fastest for the Base preset's attention (a GPU check).

Times forward + backward of ``F.scaled_dot_product_attention`` at the Base training shape (128
sequences of 512 tokens, 12 heads of 64, causal, bf16; q, k, v as the model lays them out:
``[B, L, H, hd]`` transposed to ``[B, H, L, hd]``) under each backend PyTorch offers on this
card, and checks that every backend's output and gradients agree with the math backend's in fp32.
Writes ``sdpa_backends.json`` to ``--out`` (default ``$OUT`` or ``.``) and prints a table.

``PYTHONPATH=src python3 benchmarks/sdpa/sdpa_backends.py``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/common.py
from common import SDPA_BACKENDS, timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make() -> torch.Tensor:
        x = torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        return x.transpose(1, 2).requires_grad_(True)

    q, k, v = make(), make(), make()
    grad_out = torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    n = 4  # the fp32 reference on a few sequences (the math backend's memory is O(L^2))
    with sdpa_kernel(SDPBackend.MATH):
        ref_in = [t[:n].detach().float().requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
        ref.backward(grad_out[:n].float())
    # fwd FLOPs of causal attention: 2 matmuls x 2 FLOPs x B H L^2 d / 2; bwd 2.5x that
    flops = 3.5 * 2 * b * h * s * s * d
    rows = []
    for name, backend in SDPA_BACKENDS.items():
        row: dict = {"backend": name}
        try:
            with sdpa_kernel(backend):

                def step() -> None:
                    for t in (q, k, v):
                        t.grad = None
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)

                ms, _ = timed(step, warmup=5, iters=20)
                for t in (q, k, v):
                    t.grad = None
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad_out)
            err = max(
                float((a[:n].float() - r).abs().max() / r.abs().max())
                for a, r in zip(
                    (out, q.grad, k.grad, v.grad), (ref, *(t.grad for t in ref_in)), strict=True
                )
            )
            row.update(ms=ms, tflops=flops / ms / 1e9, max_rel_err_vs_fp32_math=err)
        except RuntimeError as exc:  # backend not available for this shape / card
            row["error"] = str(exc).splitlines()[0][:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": [b, h, s, d],
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sdpa_backends.json").write_text(
        json.dumps({"meta": meta, "results": rows}, indent=2) + "\n"
    )
    print("| backend | fwd+bwd ms | TFLOP/s | max rel. err vs fp32 |")
    print("|---|---|---|---|")
    for r in rows:
        if "ms" in r:
            print(
                f"| {r['backend']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                f"{r['max_rel_err_vs_fp32_math']:.2e} |"
            )
        else:
            print(f"| {r['backend']} | - | - | {r['error']} |")


if __name__ == "__main__":
    main()
