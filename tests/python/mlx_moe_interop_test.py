#!/usr/bin/env python3
"""Interop with the real MLX tools on a mixture-of-experts model (issue 42): mlx-lm (PyPI mlx[cpu] + mlx-lm).

The model is the tiny random MoE fixture tests/fixtures/moe_wrapper_fused_bf16 (official wrapper layout, fused
trunk experts, a MoE MTP head stored per expert), with the shipped model's tokenizer copied in (mlx_lm.convert
saves one; the ids used here are below the fixture's vocabulary).
1. mlx_lm.convert -q (4-bit, group 64) of it: experts stacked under switch_mlp, router and shared-expert gate in
   8 bits, and the tensors whose input size is not a multiple of 64 (the experts' down_proj, the shared expert's)
   left in bf16, so quantization is read per tensor. mtpx loads it and its logits equal mlx-lm's (run in float32)
   within 1e-4 of the largest logit; inspect reports the MoE shape and no head (mlx-lm drops mtp.*).
2. mtpx quantize --bits 4 --method mlx: every quantized tensor mlx_lm.convert also quantizes with the same bits is
   identical to mlx_lm.convert's, bit for bit; the router and the shared-expert gate stay bf16 (routing is
   sensitive); mlx-lm loads the output and computes mtpx's logits; the MoE head is kept (quantized).
3. graft: the head of mtpx's 4-bit build onto mlx-lm's head-less build; greedy --mtp output is the plain output.
Exit code 77 (ctest: skipped) when mlx / mlx-lm are not installed.
"""
import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from mlx_common import mlx_logits, mtpx  # exits 77 (skipped) without mlx / mlx-lm

import mlx.core as mx  # noqa: E402  (present: mlx_common checked)
import numpy as np  # noqa: E402
from mlx_lm import convert  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402


def load_all(path):
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mtpx", required=True)
    ap.add_argument("--fixture", required=True, help="tests/fixtures/moe_wrapper_fused_bf16")
    ap.add_argument("--tokenizer-from", required=True, help="a model directory with tokenizer.json")
    a = ap.parse_args()
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src, mlx4, ours4, grafted = tmp / "src", tmp / "mlx4", tmp / "mtpx4", tmp / "grafted"
        shutil.copytree(a.fixture, src, ignore=shutil.ignore_patterns("reference.safetensors"))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (Path(a.tokenizer_from) / name).exists():
                shutil.copy(Path(a.tokenizer_from) / name, src / name)
        vocab = json.load(open(src / "config.json"))["text_config"]["vocab_size"]
        rng = np.random.RandomState(42)
        ids = [int(x) for x in rng.randint(0, vocab - 3, size=40)]

        convert(hf_path=str(src), mlx_path=str(mlx4), quantize=True, q_bits=4, q_group_size=64)
        mtpx(a.mtpx, "quantize", "--model", str(src), "--out", str(ours4), "--bits", "4", "--method", "mlx")

        theirs_t, ours_t = load_all(mlx4), load_all(ours4)
        stacked = [k for k in theirs_t if ".switch_mlp." in k and k.endswith(".weight")]
        check(any(theirs_t[k].dtype == mx.uint32 for k in stacked)
              and any(theirs_t[k].dtype == mx.bfloat16 for k in stacked),
              "mlx_lm.convert: switch_mlp experts, some quantized and some left bf16 (per-tensor quantization)")

        for name, path in (("mlx_lm.convert", mlx4), ("mtpx quantize --method mlx", ours4)):
            out = tmp / f"{path.name}.safetensors"
            mtpx(a.mtpx, "logits", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)), "--out", str(out))
            ours = load_file(str(out))["logits"]
            theirs = mlx_logits(path, ids)
            err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            check(err < 1e-4, f"{name} 4-bit MoE: mtpx logits vs mlx-lm (float32) relative error {err:.2e} < 1e-4")

        routing = [k for k in theirs_t if k.endswith("mlp.gate.weight") or k.endswith("shared_expert_gate.weight")]
        check(all(ours_t[k].dtype == mx.bfloat16 for k in routing) and len(routing) > 0,
              f"mtpx quantize keeps the {len(routing)} routers and shared-expert gates in bf16")
        comparable = [k for k in theirs_t if not k.startswith("mtp.") and k not in routing
                      and not any(k == r[: -len("weight")] + s for r in routing for s in ("scales", "biases"))]
        same = [k for k in comparable
                if k in ours_t and theirs_t[k].dtype == ours_t[k].dtype and theirs_t[k].shape == ours_t[k].shape
                and mx.array_equal(theirs_t[k], ours_t[k]).item()]
        check(len(same) == len(comparable),
              f"mtpx quantize --method mlx writes mlx_lm.convert's other tensors bit for bit ({len(same)}/{len(comparable)})")
        check(any(k.startswith("mtp.layers.0.mlp.") for k in ours_t), "mtpx quantize keeps the MoE MTP head")

        report = json.loads(mtpx(a.mtpx, "inspect", str(mlx4), "--json"))
        experts = report["shape"].get("experts", {})
        check(experts.get("routed") == 8 and experts.get("per_token") == 2 and report["mtp"]["status"] == "absent"
              and report["can_run"], "inspect: mlx-lm's MoE build runs, 8 experts / 2 per token, head absent")
        g = json.loads(mtpx(a.mtpx, "graft", "--trunk", str(mlx4), "--donor", str(ours4), "--out", str(grafted),
                            "--min-acceptance", "0", "--json"))
        check(g["head_tensors"] > 0, f"graft: {g['head_tensors']} head tensors moved")
        common = ["generate", "--model", str(grafted), "--prompt-ids", ",".join(map(str, ids[:12])),
                  "--max-tokens", "32", "--temperature", "0", "--json"]
        plain = json.loads(mtpx(a.mtpx, *common))
        for k in ("1", "3"):
            spec = json.loads(mtpx(a.mtpx, *common, "--mtp", "--draft", k))
            check(plain["tokens"] == spec["tokens"], f"grafted MoE model: greedy --mtp --draft {k} output == plain")
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("0 check(s) failed")


if __name__ == "__main__":
    main()
