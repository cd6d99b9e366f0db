#!/usr/bin/env python3
"""Interop with the real MLX tools (issue: quantize): mlx-lm (PyPI mlx[cpu] + mlx-lm) on this CPU.

1. mlx_lm.convert -q (4-bit) of the shipped model: mtpx loads it and its logits equal mlx-lm's (run in
   float32) within 1e-4; the conversion has no MTP head (mlx-lm drops mtp.*), which inspect reports.
2. mtpx quantize --bits 4 --method mlx: the codes, scales and biases are identical to mlx_lm.convert's;
   mlx-lm loads that output, and the default (least-squares) one, and computes the same logits as mtpx.
3. graft: the head of mtpx's 4-bit build onto mlx-lm's head-less build; the result drafts with MTP and
   greedy output stays identical to plain decoding.
Exit code 77 (ctest: skipped) when mlx / mlx-lm are not installed.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

from mlx_common import mlx_logits, mtpx  # exits 77 (skipped) without mlx / mlx-lm

import mlx.core as mx  # noqa: E402  (present: mlx_common checked)
import numpy as np  # noqa: E402
from mlx_lm import convert  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mtpx", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--samples", required=True)
    a = ap.parse_args()
    ids = json.load(open(a.samples))["samples"][0]["prompt_ids"][:48]
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        mlx4, ours4, lsq4, grafted = tmp / "mlx4", tmp / "mtpx4", tmp / "mtpx4lsq", tmp / "grafted"
        convert(hf_path=a.model, mlx_path=str(mlx4), quantize=True, q_bits=4, q_group_size=64)
        mtpx(a.mtpx, "quantize", "--model", a.model, "--out", str(ours4), "--bits", "4", "--method", "mlx")
        mtpx(a.mtpx, "quantize", "--model", a.model, "--out", str(lsq4), "--bits", "4")  # least squares

        for name, path in (("mlx_lm.convert", mlx4), ("mtpx quantize --method mlx", ours4),
                           ("mtpx quantize (least squares)", lsq4)):
            out = tmp / f"{path.name}.safetensors"
            mtpx(a.mtpx, "logits", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)), "--out", str(out))
            ours = load_file(str(out))["logits"]
            theirs = mlx_logits(path, ids)
            err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            check(err < 1e-4, f"{name} 4-bit: mtpx logits vs mlx-lm (float32) relative error {err:.2e} < 1e-4")

        a_t, b_t = mx.load(str(mlx4 / "model.safetensors")), mx.load(str(ours4 / "model.safetensors"))
        trunk = [k for k in a_t if not k.startswith("mtp.")]
        same = [k for k in trunk
                if k in b_t and a_t[k].dtype == b_t[k].dtype and a_t[k].shape == b_t[k].shape
                and mx.array_equal(a_t[k], b_t[k]).item()]
        check(len(same) == len(trunk),
              f"mtpx quantize --method mlx writes mlx_lm.convert's tensors bit for bit ({len(same)}/{len(trunk)})")
        check(any(k.startswith("mtp.") for k in b_t), "mtpx quantize keeps the MTP head")

        report = json.loads(mtpx(a.mtpx, "inspect", str(mlx4), "--json"))
        check(report["mtp"]["status"] == "absent" and report["can_run"], "inspect: mlx-lm's build runs, head absent")
        g = json.loads(mtpx(a.mtpx, "graft", "--trunk", str(mlx4), "--donor", str(ours4), "--out", str(grafted), "--json"))
        check(g["teacher_forced_acceptance"] > 0.5, f"graft: head acceptance {g['teacher_forced_acceptance']:.3f} > 0.5")
        report = json.loads(mtpx(a.mtpx, "inspect", str(grafted), "--json"))
        check(report["mtp"]["status"] == "present", "inspect: grafted head present")
        common = ["generate", "--model", str(grafted), "--prompt-ids", ",".join(map(str, ids[:16])),
                  "--max-tokens", "48", "--temperature", "0", "--json"]
        plain = json.loads(mtpx(a.mtpx, *common))
        spec = json.loads(mtpx(a.mtpx, *common, "--mtp", "--draft", "2"))
        check(plain["tokens"] == spec["tokens"], "grafted model: greedy --mtp output == plain output")
        acc = spec["stats"]["mtp"]["acceptance"]
        check(acc > 0.4, f"grafted model: measured acceptance {acc:.3f} > 0.4")
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
