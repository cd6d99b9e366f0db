#!/usr/bin/env python3
"""Carries reference outputs over to a renumbered vocabulary, and checks them against transformers.

When a model's tokens are renumbered (scripts/train_small_model.py --rank-vocab: the same model, the embedding rows
moved with their tokens), its reference outputs change only by that renumbering: token ids map through it and
the logit columns move with their tokens; hidden states do not change. This script rewrites
reference.safetensors and heldout_samples.json of --fixtures that way, then runs the renumbered model in
transformers (float32, CPU, eager attention, pure-torch GDN: the reference setup of train_small_model.py) on every
reference prompt and checks that its logits, hidden states and teacher-forced MTP logits equal the rewritten
references within 1e-5 of each row's largest value. Nothing is written unless the check passes.

    python3 scripts/renumber_fixtures.py --old OLD_MODEL_DIR --new NEW_MODEL_DIR \\
        --fixtures tests/fixtures/trained_default --out DIR

Requirements: torch, transformers==5.17.0, tokenizers, safetensors, numpy.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def new_of_old(old_dir: Path, new_dir: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    old = Tokenizer.from_file(str(old_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    new = Tokenizer.from_file(str(new_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    assert sorted(old) == sorted(new), "the two tokenizers do not hold the same tokens"
    perm = np.full(len(old), -1, dtype=np.int64)
    for token, i in old.items():
        perm[i] = new[token]
    assert sorted(perm.tolist()) == list(range(len(old))), "not a renumbering"
    return perm


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, type=Path)
    ap.add_argument("--new", required=True, type=Path)
    ap.add_argument("--fixtures", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()

    import torch
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import load_file as load_torch_file

    import make_reference_fixtures as mrf
    import train_small_model as tsm

    perm = new_of_old(a.old, a.new)
    V = len(perm)
    inv = np.argsort(perm)  # new id -> old id

    def ids(xs):
        return [int(perm[x]) for x in xs]

    ref = load_file(str(a.fixtures / "reference.safetensors"))
    out_ref = {}
    for name, t in ref.items():
        if name.startswith("prompt_"):
            out_ref[name] = perm[t].astype(t.dtype)
        elif name.startswith(("logits_", "mtp_logits_")):
            assert t.shape[-1] == V, (name, t.shape)
            out_ref[name] = np.ascontiguousarray(t[:, inv])  # column new = old column inv[new]
        else:
            out_ref[name] = t

    samples = json.loads((a.fixtures / "heldout_samples.json").read_text())
    for s in samples["samples"]:
        for key in ("prompt_ids", "next_ids", "greedy_ids"):
            s[key] = ids(s[key])
        tf = s["teacher_forced"]
        for key in ("ids", "trunk_argmax", "mtp_argmax"):
            tf[key] = ids(tf[key])

    # The check: transformers on the renumbered model reproduces the rewritten references.
    cfg_json = json.loads((a.new / "config.json").read_text())
    tc = {k: v for k, v in cfg_json["text_config"].items() if k != "model_type"}
    cfg = tsm.hf_config(tc, "eager")
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM(cfg).float().eval()
    tensors = {k: v.float() for k, v in load_torch_file(str(a.new / "model.safetensors")).items()}
    head = tsm.make_mtp_head(cfg).float().eval()
    tsm.load_init_weights(model, head, tensors)
    mtp_sd = {n: t for n, t in tensors.items() if n.startswith("mtp.")}
    worst = 0.0
    with tsm.PureTorchGDN(), torch.no_grad():
        n = len([k for k in out_ref if k.startswith("prompt_")])
        for i in range(n):
            x = torch.from_numpy(out_ref[f"prompt_{i}"].astype(np.int64))
            h = model.model(input_ids=x[None], use_cache=False).last_hidden_state[0]
            ml, mh = mrf.mtp_forward_hf(model, mtp_sd, cfg, x, h)
            for name, got in (("logits", model.lm_head(h)), ("hidden", h), ("mtp_logits", ml), ("mtp_hidden", mh)):
                want = out_ref[f"{name}_{i}"].astype(np.float64)
                diff = np.abs(got.double().numpy() - want).max(-1) / np.maximum(np.abs(want).max(-1), 1e-30)
                worst = max(worst, float(diff.max()))
                print(f"  transformers vs renumbered reference {name}_{i}: max relative row error {diff.max():.2e}")
    if not worst < 1e-5:
        sys.exit(f"renumbered references do not match transformers (max relative row error {worst:.2e})")

    a.out.mkdir(parents=True, exist_ok=True)
    save_file(out_ref, str(a.out / "reference.safetensors"), metadata={
        "generator": "scripts/train_small_model.py (transformers float32 CPU eager), token ids renumbered by "
                     "scripts/renumber_fixtures.py and checked against transformers on the renumbered model"})
    samples["description"] += "; token ids renumbered by scripts/renumber_fixtures.py"
    (a.out / "heldout_samples.json").write_text(json.dumps(samples, indent=1) + "\n")
    print(f"wrote {a.out}/reference.safetensors and heldout_samples.json (checked: {worst:.2e})")


if __name__ == "__main__":
    main()
