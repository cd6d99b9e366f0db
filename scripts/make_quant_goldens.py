#!/usr/bin/env python3
"""Builds the affine-quantization goldens under tests/fixtures/quant_goldens/.

Runs MLX's own quantizer, mx.quantize(w, group_size, bits) in mode "affine", on a small deterministic
float32 matrix and records what it returns. tests/quant_matmul_test.cpp checks mtpx::cpu::quantize_affine
against these files (codes, scales and biases bit for bit) and thereby also the packing order of the codes.

The matrix is 8 x 256: rows of normal values, a row of zeros, a row of one repeated value, a row whose
groups are each constant, an all-positive and an all-negative row (the edge of larger magnitude is then
max and min respectively), a narrow row far from zero, and a row on a coarse grid (many rounding ties).

Usage: python3 scripts/make_quant_goldens.py   (deterministic; needs numpy, safetensors and mlx, CPU is
enough; rerun after changing anything here)

Outputs (all committed):
  tests/fixtures/quant_goldens/input.safetensors      w: F32 [8, 256]
  tests/fixtures/quant_goldens/b{bits}_g{group}.safetensors
      packed: U32 [8, 256 * bits / 32], scales: F32 [8, 256 / group], biases: F32 [8, 256 / group]
      (bits and group follow from the shapes); metadata "source": the call and the MLX version
"""

import os

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "fixtures", "quant_goldens")

ROWS, COLS = 8, 256
# (bits, group_size): the formats the engine uses (4/6/8 bits, group 64; 4 bits, group 32) and the odd
# widths whose codes straddle 32-bit words (3, 5) plus 2 bits, to pin the packing order.
CASES = [(4, 64), (6, 64), (8, 64), (4, 32), (2, 128), (3, 64), (5, 32)]


def make_input():
    rng = np.random.default_rng(20261130)
    w = np.zeros((ROWS, COLS), dtype=np.float32)
    w[0] = rng.standard_normal(COLS)
    # w[1] stays all zeros.
    w[2] = 0.3
    w[3] = np.repeat(np.array([-1.25, 0.5, 2.0, -0.0625]), COLS // 4)  # constant groups for group <= 64
    w[4] = rng.uniform(0.0, 2.0, COLS)  # all positive: max is the edge
    w[5] = -rng.uniform(0.0, 2.0, COLS)  # all negative: min is the edge
    w[6] = 0.5 + 0.01 * rng.standard_normal(COLS)  # narrow range far from zero
    w[7] = np.round(rng.uniform(-2.0, 2.0, COLS) * 8.0) / 8.0  # a coarse grid: rounding ties
    return w.astype(np.float32)


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    w = make_input()
    save_file({"w": w}, os.path.join(OUT_DIR, "input.safetensors"))
    for bits, group in CASES:
        packed, scales, biases = mx.quantize(mx.array(w), group_size=group, bits=bits, mode="affine")
        tensors = {
            "packed": np.ascontiguousarray(np.array(packed, dtype=np.uint32)),
            "scales": np.ascontiguousarray(np.array(scales, dtype=np.float32)),
            "biases": np.ascontiguousarray(np.array(biases, dtype=np.float32)),
        }
        assert tensors["packed"].shape == (ROWS, COLS * bits // 32), tensors["packed"].shape
        # One metadata key: the writer orders several keys differently from run to run.
        metadata = {"source": f"mx.quantize(w, group_size={group}, bits={bits}, mode='affine'), mlx {mx.__version__}"}
        path = os.path.join(OUT_DIR, f"b{bits}_g{group}.safetensors")
        save_file(tensors, path, metadata=metadata)
        print(f"{path}: packed {tensors['packed'].shape}, scales {tensors['scales'].shape}")


if __name__ == "__main__":
    main()
