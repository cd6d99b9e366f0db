#!/usr/bin/env python3
"""Builds tiny random Qwen3.5 checkpoints and records transformers' float32 reference outputs.

Usage
-----
    python3 scripts/make_reference_fixtures.py                 # writes tests/fixtures/<case>/ for all cases
    python3 scripts/make_reference_fixtures.py --cases causal_f16_interval2 --out /tmp/fx
    python3 scripts/make_reference_fixtures.py --device cuda   # same fixtures, reference computed on a GPU
    python3 scripts/make_placeholder_model.py                  # the random placeholder models/default/ (separate script)

Requirements: scripts/requirements.txt (torch, transformers==5.17.0, safetensors, numpy). Runs on CPU in about a
minute. Everything is deterministic: parameters are drawn from per-tensor seeded torch.Generators on the CPU (seed =
case seed + crc32(tensor name)), prompts from numpy RandomState(case seed). The float32 reference is computed with
TF32 disabled; CPU and GPU results agree to ~1e-6 but are not bit-identical (default device: cpu).

Cases (each a directory tests/fixtures/<case>/)
-----------------------------------------------
  wrapper_sharded_tied_bf16   official multimodal layout (Qwen3_5ForConditionalGeneration, text_config nested,
                              vision_config, keys model.language_model.*, 2 fake model.visual.* tensors that loaders
                              must ignore, 15 random mtp.* tensors), tied embeddings (no lm_head.weight), bf16,
                              3 shards + model.safetensors.index.json, generation_config.json; no layer_types key,
                              full_attention_interval 4 (layer 3 is full attention).
  causal_untied_single_bf16   text-only layout (Qwen3_5ForCausalLM, keys model.* + lm_head.weight), single
                              model.safetensors, explicit layer_types, odd head counts (nq 3 / nkv 1, Hk 2 / Hv 6,
                              Dk 16, Dv 24), OLD flat rope spelling: top-level rope_theta / partial_rotary_factor.
  causal_f16_interval2        text-only layout, float16 storage, full_attention_interval 2 (no layer_types), nested
                              rope_parameters with non-default theta 1e6 and partial_rotary_factor 0.5, Hv == Hk.
  causal_mtp_untied_f32       text-only layout, float32 storage, untied lm_head, 4 layers with full_attention_interval 2,
                              nq 2 / nkv 1, rope theta 1e7 / partial_rotary_factor 0.25 (rotary dim 8), 15 random
                              mtp.* tensors (mtp_num_hidden_layers 1): covers an untied + F32 MTP head.

Every parameter is randomised explicitly (transformers would initialise the (1+w) norm weights to zero, which would
hide bugs), then rounded to the storage dtype and back, so the float32 reference model uses exactly the stored values:
  nn.Linear [out, in]  N(0, 1/in)  (o_proj / out_proj / down_proj times the case's out_gain; lm_head std 2/sqrt(H))
  embed_tokens N(0, 1); (1+w) norms (input/post_attention_layernorm, model.norm, q_norm, k_norm, mtp norms) N(0, 0.2^2);
  linear_attn.norm.weight (plain w) 1 + N(0, 0.2^2); A_log U(-1, 1.5); dt_bias N(0, 0.5^2); conv1d.weight N(0, 0.3^2).

reference.safetensors (per case; i = 0, 1, 2 for prompts of length 1, 11, 80 -- 80 > 64 crosses a GDN chunk boundary)
  prompt_{i}         int32   [n]      random ids in [0, V-3]; drawn from numpy RandomState(case seed), redrawn (same
                                      stream) until every greedy step has a top1-top2 margin >= MIN_MARGIN (0.05)
  logits_{i}         float32 [n, V]   full forward over the prompt, no cache (chunked GDN path)
  hidden_{i}         float32 [n, H]   post-final-norm hidden state = the exact input of lm_head
  greedy_{i}         int32   [G]      model.generate(do_sample=False, use_cache=True, max_new_tokens=G), no EOS stop
  greedy_margin_{i}  float32 [G]      top-1 minus top-2 raw logit at each generated step
  decode_logits_{i}  float32 [G, V]   raw logits of each generate step: row 0 = last row of the (cached, chunked)
                                      prefill, rows 1.. = single-token cached decode steps (recurrent GDN path)
  G = 12.
  Cases with an MTP head (wrapper_sharded_tied_bf16, causal_mtp_untied_f32) also have
  mtp_logits_{i}     float32 [n-1, V] teacher-forced MTP head: row t (t = 0..n-2) has inputs h_t = hidden_{i}[t],
                                      token prompt[t+1], RoPE position t, and attends causally over MTP rows 0..t of
                                      the same pass (its own KV cache); it predicts prompt token t+2. Shape [0, V] for
                                      the 1-token prompt.
  mtp_hidden_{i}     float32 [n-1, H] the MTP output hidden RMSNorm1p(u, mtp.norm) of each row (= input of the head)
  The MTP formula (qwen35_arch.md §6; transformers has no MTP module) is written out above mtp_forward_hf below:
  e = RMSNorm1p(embed[x_{t+1}], pre_fc_norm_embedding), hh = RMSNorm1p(h_t, pre_fc_norm_hidden),
  u = concat(e, hh) @ mtp.fc^T (embedding first), one full-attention decoder layer mtp.layers.0 (gated attention, q/k
  norm, partial RoPE with the trunk's rope parameters, SwiGLU), m = RMSNorm1p(u, mtp.norm), logits = m @ W_head^T
  (lm_head, or embed_tokens when tied). The written values come from transformers' own Qwen3_5DecoderLayer /
  Qwen3_5RMSNorm / rotary embedding / causal mask with the stored mtp.* values loaded into them.

Suggested tolerances for an fp32 engine: |logits diff| <= ~1e-4 * max(1, max|logit|) (transformers' own chunked-vs-
recurrent paths disagree by up to 1.9e-4 abs on the tied case, whose logits reach |35|; ~2e-5 on the others), hidden
~1e-4; greedy tokens exact (every step has margin >= 0.05). mtp_logits / mtp_hidden: the same tolerances (transformers'
MTP layer run as one causal pass vs row by row through its KV cache disagrees by up to 2.1e-5 on the tied case, whose
mtp_logits reach |39|; the independent spec implementation agrees to 2.4e-5 there, ~3e-6 on the F32 case).

transformers code paths (5.17.0, without flash-linear-attention / causal-conv1d / kernels installed): the GDN layer
uses the pure-torch fallbacks torch_chunk_gated_delta_rule (every multi-token call, incl. 1-token prefill) and
torch_recurrent_gated_delta_rule (cached single-token decode), causal_conv1d_fn / causal_conv1d_update (F.conv1d).
The script prints which implementations were resolved.

Sanity checks printed per case: forward(prompt + greedy[:-1]) logits vs step-by-step decode logits; argmax of decode
logits vs greedy tokens; lm_head input vs model.norm output; reloading the written directory with from_pretrained
reproduces the logits (exactly for bf16/f16 storage; the F32 case differs by ~3e-6 on the 1-token prompt because
from_pretrained memory-maps F32 weights at addresses that are not 64-byte aligned and BLAS then takes another kernel);
an independent pure-torch implementation written from the spec (/work/shared/reference/qwen35_arch.md, token-recurrent
GDN) reproduces the logits. For MTP cases: transformers' layer run as one causal pass vs row by row through a
DynamicCache, and an independent token-by-token spec implementation (spec_mtp) vs the written mtp_* tensors.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
G_STEPS = 12
PROMPT_LENGTHS = (1, 11, 80)
MIN_MARGIN = 0.05  # prompts are redrawn until every greedy step has top1 - top2 >= this (robust to fp32 rounding)
MAX_PROMPT_DRAWS = 100
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}

# ---------------------------------------------------------------------------------------------------------------
# Case definitions. `text` holds the text hyper-parameters exactly as they are written to config.json.
# ---------------------------------------------------------------------------------------------------------------

CASES = {
    "wrapper_sharded_tied_bf16": dict(
        seed=1001,
        dtype="bf16",
        layout="wrapper",
        out_gain=3.0,  # tied + std-1 embeddings: without it the residual is dominated by the input token's embedding
        #               and greedy decoding just repeats one token
        shards=3,
        tied=True,
        mtp=True,
        text={
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 4096,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "output_gate_type": "swish",
            "partial_rotary_factor": 0.25,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_interleaved": True,
                "mrope_section": [3, 3, 2],  # sums to rotary_dim / 2 = 64 * 0.25 / 2 = 8
            },
            "tie_word_embeddings": True,
            "use_cache": True,
            "dtype": "bfloat16",
            "bos_token_id": 511,
            "eos_token_id": 511,
        },
    ),
    "causal_untied_single_bf16": dict(
        seed=2002,
        dtype="bf16",
        layout="causal",
        shards=1,
        tied=False,
        mtp=False,
        text={
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 5,
            "layer_types": [
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            "num_attention_heads": 3,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 24,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 6,
            "max_position_embeddings": 4096,
            # old flat rope spelling (no rope_parameters)
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
        },
    ),
    "causal_f16_interval2": dict(
        seed=3003,
        dtype="f16",
        layout="causal",
        shards=1,
        tied=False,
        mtp=False,
        text={
            "vocab_size": 384,
            "hidden_size": 96,
            "intermediate_size": 224,
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 3,
            "linear_num_value_heads": 3,
            "max_position_embeddings": 4096,
            "mtp_num_hidden_layers": 0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.5,
            },
            "tie_word_embeddings": False,
            "dtype": "float16",
        },
    ),
    "causal_mtp_untied_f32": dict(
        seed=4004,
        dtype="f32",
        layout="causal",
        shards=1,
        tied=False,
        mtp=True,
        text={
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attn_output_gate": True,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "max_position_embeddings": 4096,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
            },
            "tie_word_embeddings": False,
            "dtype": "float32",
        },
    ),
}

# ---------------------------------------------------------------------------------------------------------------
# Randomisation
# ---------------------------------------------------------------------------------------------------------------

ONE_PLUS_W_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def _gen(seed: int, name: str) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


RESIDUAL_OUT_PROJ = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def random_tensor(name: str, shape, seed: int, hidden: int, out_gain: float = 1.0) -> torch.Tensor:
    """Seeded float32 value for tensor `name` (canonical name without the model./language_model. prefix).

    out_gain multiplies the std of the projections that write into the residual stream (o_proj, out_proj,
    down_proj)."""
    g = _gen(seed, name)
    shape = tuple(shape)

    def normal(std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    if name.endswith("A_log"):
        return torch.rand(shape, generator=g, dtype=torch.float32) * 2.5 - 1.0  # U(-1, 1.5)
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("conv1d.weight"):
        return normal(0.3)
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain w
        return normal(0.2, 1.0)
    if name.endswith(ONE_PLUS_W_NORMS) or name in ("norm.weight", "mtp.norm.weight"):  # (1+w) norms
        return normal(0.2)
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name == "lm_head.weight":
        return normal(2.0 / math.sqrt(hidden))
    if len(shape) == 2:  # nn.Linear [out, in]
        return normal((out_gain if name.endswith(RESIDUAL_OUT_PROJ) else 1.0) / math.sqrt(shape[1]))
    raise ValueError(f"no randomisation rule for {name} {shape}")


def canonical(name: str) -> str:
    """HF parameter name -> name used for seeding (layout independent)."""
    for p in ("model.language_model.", "model."):
        if name.startswith(p):
            return name[len(p):]
    return name


def round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(torch.float32)


def randomize_model(model, seed: int, dtype: torch.dtype, hidden: int, out_gain: float = 1.0):
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head is deduplicated (shares embed_tokens)
            v = random_tensor(canonical(name), p.shape, seed, hidden, out_gain)
            p.copy_(round_to(v, dtype))


def mtp_shapes(tc: dict) -> dict:
    H, D = tc["hidden_size"], tc["head_dim"]
    nq, nkv, inter = tc["num_attention_heads"], tc["num_key_value_heads"], tc["intermediate_size"]
    return {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nq * D, H),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * D, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * D, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, nq * D),
        "mtp.layers.0.self_attn.q_norm.weight": (D,),
        "mtp.layers.0.self_attn.k_norm.weight": (D,),
        "mtp.layers.0.mlp.gate_proj.weight": (inter, H),
        "mtp.layers.0.mlp.up_proj.weight": (inter, H),
        "mtp.layers.0.mlp.down_proj.weight": (H, inter),
    }


def mtp_tensors(tc: dict, seed: int, dtype: torch.dtype, out_gain: float = 1.0) -> dict:
    return {n: random_tensor(n, s, seed, tc["hidden_size"], out_gain).to(dtype) for n, s in mtp_shapes(tc).items()}


# ---------------------------------------------------------------------------------------------------------------
# Config handling
# ---------------------------------------------------------------------------------------------------------------

VISION_CONFIG = {
    "model_type": "qwen3_5",  # as in the official checkpoints (transformers remaps it to qwen3_5_vision)
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
}


def fake_vision_tensors(seed: int, dtype: torch.dtype) -> dict:
    hv = VISION_CONFIG["hidden_size"]
    out = {}
    for name, shape in (("model.visual.blocks.0.attn.qkv.weight", (3 * hv, hv)),
                        ("model.visual.blocks.0.attn.qkv.bias", (3 * hv,))):
        out[name] = (torch.randn(shape, generator=_gen(seed, name)) * 0.02).to(dtype)
    return out


def full_config(case: dict) -> dict:
    """The config.json written to disk."""
    tc = copy.deepcopy(case["text"])
    if case["layout"] == "wrapper":
        V = tc["vocab_size"]
        text = {"model_type": "qwen3_5_text", **tc}
        return {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "text_config": text,
            "vision_config": dict(VISION_CONFIG, out_hidden_size=tc["hidden_size"]),
            "tie_word_embeddings": case["tied"],
            "image_token_id": V - 6,
            "video_token_id": V - 5,
            "vision_start_token_id": V - 4,
            "vision_end_token_id": V - 3,
            "language_model_only": False,
            "transformers_version": "5.17.0",
        }
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **tc,
            "transformers_version": "5.17.0"}


def text_config_for_hf(case: dict):
    """Qwen3_5TextConfig built from the same values that are written to config.json."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    tc = copy.deepcopy(case["text"])
    tc.pop("dtype", None)
    cfg = Qwen3_5TextConfig(**tc)
    cfg._attn_implementation = "eager"
    return cfg


def check_rope(cfg, case):
    tc = case["text"]
    rp = tc.get("rope_parameters", {})
    theta = rp.get("rope_theta", tc.get("rope_theta"))
    prf = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor"))
    got = cfg.rope_parameters
    assert got["rope_theta"] == theta and got["partial_rotary_factor"] == prf, (got, theta, prf)


# ---------------------------------------------------------------------------------------------------------------
# Writing checkpoints
# ---------------------------------------------------------------------------------------------------------------


def checkpoint_tensors(model, case: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    """Returns ({name: tensor in storage dtype}, {name: shard index}) in the case's on-disk naming."""
    from safetensors.torch import save_file  # noqa: F401  (import check)

    seed = case["seed"]
    sd = model.state_dict()
    tensors, shard_of = {}, {}
    L = case["text"]["num_hidden_layers"]
    nshards = case["shards"]
    for name, t in sd.items():
        if name == "lm_head.weight" and case["tied"]:
            continue
        out_name = name
        if case["layout"] == "wrapper" and name.startswith("model."):
            out_name = "model.language_model." + name[len("model."):]
        tensors[out_name] = t.detach().to("cpu", dtype).contiguous()
        # shard: layers split evenly over the first nshards-1 shards; everything else -> first / last shard
        if nshards == 1:
            shard_of[out_name] = 0
        elif ".layers." in out_name:
            li = int(out_name.split(".layers.")[1].split(".")[0])
            shard_of[out_name] = min(li * (nshards - 1) // L, nshards - 2)
        elif "embed_tokens" in out_name:
            shard_of[out_name] = 0
        else:  # final norm, lm_head
            shard_of[out_name] = nshards - 1
    if case["mtp"]:
        for n, t in mtp_tensors(case["text"], seed, dtype, case.get("out_gain", 1.0)).items():
            tensors[n] = t
            shard_of[n] = nshards - 1
    if case["layout"] == "wrapper":
        for n, t in fake_vision_tensors(seed, dtype).items():
            tensors[n] = t
            shard_of[n] = 0
    return tensors, shard_of


def write_checkpoint(outdir: Path, case: dict, tensors: dict, shard_of: dict):
    from safetensors.torch import save_file

    outdir.mkdir(parents=True, exist_ok=True)
    for f in outdir.glob("model*.safetensors*"):
        f.unlink()
    nshards = case["shards"]
    if nshards == 1:
        save_file(tensors, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        total = 0
        for s in range(nshards):
            fname = f"model-{s + 1:05d}-of-{nshards:05d}.safetensors"
            part = {n: t for n, t in tensors.items() if shard_of[n] == s}
            save_file(part, str(outdir / fname), metadata={"format": "pt"})
            for n, t in part.items():
                weight_map[n] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (outdir / "config.json").write_text(json.dumps(full_config(case), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Independent spec implementation (qwen35_arch.md §2-§5), token-recurrent GDN, float32, no transformers code.
# ---------------------------------------------------------------------------------------------------------------


def spec_forward(sd: dict, cfg, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sd: float32 state dict with HF names (model.*, lm_head.weight). Returns (logits [T,V], hfin [T,H])."""
    eps = cfg.rms_norm_eps
    H, D = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    Hk, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    Kc = cfg.linear_conv_kernel_dim
    rot = int(D * cfg.rope_parameters["partial_rotary_factor"])
    theta = cfg.rope_parameters["rope_theta"]
    T = ids.shape[0]

    def rms1p(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    def W(n):
        return sd[n]

    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [T, rot/2]
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # [T, heads, D], NeoX pairs (i, i + rot/2) inside the first rot dims
        h = rot // 2
        x1, x2, rest = x[..., :h], x[..., h:rot], x[..., rot:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    x = W("model.embed_tokens.weight")[ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms1p(x, W(p + "input_layernorm.weight"))
        if cfg.layer_types[i] == "full_attention":
            a = p + "self_attn."
            qg = (h @ W(a + "q_proj.weight").T).view(T, nq, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(T, nq * D)
            k = (h @ W(a + "k_proj.weight").T).view(T, nkv, D)
            v = (h @ W(a + "v_proj.weight").T).view(T, nkv, D)
            q = rope(rms1p(q, W(a + "q_norm.weight")))
            k = rope(rms1p(k, W(a + "k_norm.weight")))
            rep = nq // nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            s = torch.einsum("thd,shd->hts", q, k) * D ** -0.5
            s = s + torch.full((T, T), float("-inf")).triu(1)
            o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, nq * D)
            o = o * torch.sigmoid(gate)
            out = o @ W(a + "o_proj.weight").T
        else:
            a = p + "linear_attn."
            qkv = h @ W(a + "in_proj_qkv.weight").T  # [T, conv_dim]
            z = (h @ W(a + "in_proj_z.weight").T).view(T, Hv, Dv)
            b = h @ W(a + "in_proj_b.weight").T
            av = h @ W(a + "in_proj_a.weight").T
            cw = W(a + "conv1d.weight")[:, 0, :]  # [conv_dim, Kc]
            xin = torch.cat([torch.zeros(Kc - 1, qkv.shape[1]), qkv], 0)
            y = sum(cw[:, j] * xin[j:j + T] for j in range(Kc))
            y = F.silu(y)
            q = y[:, :Hk * Dk].view(T, Hk, Dk)
            k = y[:, Hk * Dk:2 * Hk * Dk].view(T, Hk, Dk)
            v = y[:, 2 * Hk * Dk:].view(T, Hv, Dv)
            beta = torch.sigmoid(b)
            g = -torch.exp(W(a + "A_log")) * F.softplus(av + W(a + "dt_bias"))
            q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * Dk ** -0.5
            k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            S = torch.zeros(Hv, Dk, Dv)
            o = torch.zeros(T, Hv, Dv)
            r = Hv // Hk
            for t in range(T):
                for hh in range(Hv):
                    kh = hh // r
                    S[hh] = torch.exp(g[t, hh]) * S[hh]
                    kv = k[t, kh] @ S[hh]
                    delta = beta[t, hh] * (v[t, hh] - kv)
                    S[hh] = S[hh] + torch.outer(k[t, kh], delta)
                    o[t, hh] = q[t, kh] @ S[hh]
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * W(a + "norm.weight") * F.silu(z)
            out = o.reshape(T, Hv * Dv) @ W(a + "out_proj.weight").T
        x = x + out
        h = rms1p(x, W(p + "post_attention_layernorm.weight"))
        m = p + "mlp."
        x = x + (F.silu(h @ W(m + "gate_proj.weight").T) * (h @ W(m + "up_proj.weight").T)) @ W(
            m + "down_proj.weight").T
    hfin = rms1p(x, W("model.norm.weight"))
    head = sd.get("lm_head.weight", W("model.embed_tokens.weight"))
    return hfin @ head.T, hfin


# ---------------------------------------------------------------------------------------------------------------
# MTP head reference (qwen35_arch.md §6), teacher-forced. transformers has no MTP module, so the reference reuses
# transformers' own Qwen3_5DecoderLayer (full attention) / Qwen3_5RMSNorm / rotary embedding / causal mask with the
# mtp.* weights loaded into them; spec_mtp below is an independent token-by-token implementation used as a cross-check.
#
#   row t = 0..n-2:  h_t = hidden_{i}[t] (post-final-norm trunk hidden = lm_head input), token x_{t+1} = prompt[t+1],
#                    RoPE position t, MTP KV slot t (attends causally over MTP rows 0..t of this same pass)
#   e  = RMSNorm1p(embed_tokens[x_{t+1}], mtp.pre_fc_norm_embedding);  hh = RMSNorm1p(h_t, mtp.pre_fc_norm_hidden)
#   u  = concat(e, hh) @ mtp.fc.weight^T                        (embedding FIRST, hidden SECOND)
#   u  = full-attention decoder layer mtp.layers.0.* (same code as the trunk's full-attention layers)
#   m  = RMSNorm1p(u, mtp.norm)           -> mtp_hidden_{i}[t]
#   mtp_logits_{i}[t] = m @ W_head^T      (lm_head.weight, or embed_tokens.weight when tied); predicts x_{t+2}
# ---------------------------------------------------------------------------------------------------------------

MTP_PREFIX = "mtp.layers.0."


def mtp_forward_hf(model, mtp_sd: dict, cfg, ids: torch.Tensor, hidden: torch.Tensor,
                   incremental: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced MTP pass built from transformers modules. model: the float32 Qwen3_5ForCausalLM (shared
    embed_tokens / lm_head / rotary_emb); mtp_sd: {"mtp.*": float32 tensor} (the stored values); ids [n] long;
    hidden [n, H] = trunk post-final-norm hidden. Returns (logits [n-1, V], mtp hidden [n-1, H]).

    incremental=False: one causal pass over all n-1 rows (eager attention, transformers' create_causal_mask).
    incremental=True: one row at a time through a DynamicCache (the MTP layer's own KV cache)."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    dev = hidden.device
    H, V = cfg.hidden_size, cfg.vocab_size
    T = ids.shape[0] - 1
    if T <= 0:
        return torch.zeros(0, V, device=dev), torch.zeros(0, H, device=dev)
    lcfg = copy.deepcopy(cfg)
    lcfg.layer_types = ["full_attention"]
    lcfg.num_hidden_layers = 1
    lcfg._attn_implementation = "eager"
    layer = Qwen3_5DecoderLayer(lcfg, layer_idx=0)
    assert layer.block_type == "full_attention"
    layer.load_state_dict({k[len(MTP_PREFIX):]: v for k, v in mtp_sd.items() if k.startswith(MTP_PREFIX)}, strict=True)

    def norm(wname):
        n = Qwen3_5RMSNorm(H, eps=cfg.rms_norm_eps)
        n.load_state_dict({"weight": mtp_sd[wname]})
        return n

    fc = torch.nn.Linear(2 * H, H, bias=False)
    fc.load_state_dict({"weight": mtp_sd["mtp.fc.weight"]})
    mods = [layer, fc, norm_e := norm("mtp.pre_fc_norm_embedding.weight"),
            norm_h := norm("mtp.pre_fc_norm_hidden.weight"), norm_f := norm("mtp.norm.weight")]
    for mod in mods:
        mod.float().eval().to(dev)

    e = norm_e(model.model.embed_tokens(ids[1:].to(dev)))  # tokens x_1 .. x_{n-1}
    hh = norm_h(hidden[:-1])  # hiddens h_0 .. h_{n-2}
    u = fc(torch.cat([e, hh], dim=-1))[None]  # [1, T, H]
    pos = torch.arange(T, device=dev)[None]  # [1, T] RoPE positions 0 .. n-2
    # text-only input: all three M-RoPE axes carry the ordinary token index (as Qwen3_5TextModel.forward does)
    cos, sin = model.model.rotary_emb(u, pos[None].expand(3, 1, T))
    if not incremental:
        mask = create_causal_mask(config=lcfg, inputs_embeds=u, attention_mask=None, past_key_values=None,
                                  position_ids=pos)
        assert mask is not None
        out = layer(u, position_embeddings=(cos, sin), attention_mask=mask, position_ids=pos)
    else:
        cache = DynamicCache(config=lcfg)
        rows = []
        for t in range(T):  # a single query row attends to the whole cache (slots 0..t): no mask needed
            rows.append(layer(u[:, t:t + 1], position_embeddings=(cos[:, t:t + 1], sin[:, t:t + 1]),
                              attention_mask=None, position_ids=pos[:, t:t + 1], past_key_values=cache))
        assert cache.get_seq_length() == T
        out = torch.cat(rows, dim=1)
    m = norm_f(out)[0]
    return model.lm_head(m), m


def spec_mtp(sd: dict, mtp_sd: dict, cfg, ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent token-by-token MTP implementation from qwen35_arch.md §6 + §3 with an explicit KV list.
    sd: float32 trunk state dict (HF names); mtp_sd: float32 mtp.* tensors. Returns (logits [n-1,V], hidden [n-1,H])."""
    eps = cfg.rms_norm_eps
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    rot = int(D * cfg.rope_parameters["partial_rotary_factor"])
    theta = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))

    def rms1p(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    def rope(x, t):  # [heads, D]; NeoX pairs (i, i + rot/2) within the first rot dims
        ang = float(t) * inv_freq
        c, s = ang.cos(), ang.sin()
        h = rot // 2
        x1, x2, rest = x[:, :h], x[:, h:rot], x[:, rot:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    def M(n):
        return mtp_sd["mtp." + n]

    emb = sd["model.embed_tokens.weight"]
    head = sd.get("lm_head.weight", emb)
    a = "layers.0.self_attn."
    f = "layers.0.mlp."
    kcache, vcache, outs, logits = [], [], [], []
    for t in range(ids.shape[0] - 1):
        e = rms1p(emb[ids[t + 1]], M("pre_fc_norm_embedding.weight"))
        hh = rms1p(hidden[t], M("pre_fc_norm_hidden.weight"))
        u = torch.cat([e, hh]) @ M("fc.weight").T  # [H]
        x = rms1p(u, M("layers.0.input_layernorm.weight"))
        qg = (x @ M(a + "q_proj.weight").T).view(nq, 2 * D)
        q, gate = qg[:, :D], qg[:, D:].reshape(nq * D)
        k = (x @ M(a + "k_proj.weight").T).view(nkv, D)
        v = (x @ M(a + "v_proj.weight").T).view(nkv, D)
        kcache.append(rope(rms1p(k, M(a + "k_norm.weight")), t))
        vcache.append(v)
        q = rope(rms1p(q, M(a + "q_norm.weight")), t)
        K, Vv = torch.stack(kcache), torch.stack(vcache)  # [t+1, nkv, D]
        o = torch.empty(nq, D)
        for j in range(nq):
            kv = j // (nq // nkv)
            p = torch.softmax((K[:, kv] @ q[j]) * D ** -0.5, dim=0)
            o[j] = p @ Vv[:, kv]
        u = u + (o.reshape(nq * D) * torch.sigmoid(gate)) @ M(a + "o_proj.weight").T
        x = rms1p(u, M("layers.0.post_attention_layernorm.weight"))
        u = u + (F.silu(x @ M(f + "gate_proj.weight").T) * (x @ M(f + "up_proj.weight").T)) @ M(f + "down_proj.weight").T
        m = rms1p(u, M("norm.weight"))
        outs.append(m)
        logits.append(m @ head.T)
    if not outs:
        return torch.zeros(0, V), torch.zeros(0, H)
    return torch.stack(logits), torch.stack(outs)


# ---------------------------------------------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------------------------------------------


def gdn_impls() -> dict:
    """Which implementation transformers resolved for the GDN helper functions."""
    import transformers.integrations.hub_kernels as hk
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    out = {}
    for fname in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                  "causal_conv1d_update"):
        f = getattr(m, fname)
        cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
        impl = cells["implementation"].cell_contents if "implementation" in cells else f
        out[fname] = f"{impl.__module__}.{impl.__name__}"
    out["kernels_hub_enabled"] = str(getattr(hk, "_kernels_enabled", False))
    return out


class Tracer:
    """Records which GDN code path each forward call takes (chunk vs recurrent)."""

    def __init__(self):
        self.calls = []
        self._orig = {}

    def __enter__(self):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        for fname in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                      "causal_conv1d_update"):
            orig = getattr(m, fname)
            self._orig[fname] = orig

            def wrapped(*a, _orig=orig, _name=fname, **kw):
                self.calls.append(_name)
                return _orig(*a, **kw)

            setattr(m, fname, wrapped)
        return self

    def __exit__(self, *exc):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m

        for fname, orig in self._orig.items():
            setattr(m, fname, orig)


def run_case(name: str, case: dict, outroot: Path, device: str, spec_check: bool) -> dict:
    import transformers
    from safetensors.torch import save_file
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    print(f"\n=== {name} ===")
    dtype = DTYPES[case["dtype"]]
    seed = case["seed"]
    torch.manual_seed(seed)
    cfg = text_config_for_hf(case)
    check_rope(cfg, case)
    V, H = cfg.vocab_size, cfg.hidden_size
    model = Qwen3_5ForCausalLM(cfg)
    randomize_model(model, seed, dtype, H, case.get("out_gain", 1.0))
    if case["tied"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tie failed"
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model = model.float().eval().to(device)

    outdir = outroot / name
    tensors, shard_of = checkpoint_tensors(model, case, dtype)
    write_checkpoint(outdir, case, tensors, shard_of)
    if case["layout"] == "wrapper":
        V_ = V
        gen = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95, "eos_token_id": [V_ - 2, V_ - 1],
               "bos_token_id": V_ - 1, "pad_token_id": V_ - 1, "transformers_version": "5.17.0"}
        (outdir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    # hooks: model.norm output and lm_head input must agree
    captured = {}
    h1 = model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("norm_out", o.detach()))
    h2 = model.lm_head.register_forward_pre_hook(lambda m, i: captured.__setitem__("head_in", i[0].detach()))

    rng = np.random.RandomState(seed)
    ref = {}
    report = {"paths": {}, "max_decode_vs_forward": 0.0, "min_margin": float("inf")}
    from transformers import GenerationConfig

    gcfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=G_STEPS, min_new_tokens=G_STEPS,
                            eos_token_id=None, bos_token_id=None, pad_token_id=0, use_cache=True,
                            output_logits=True, output_scores=True, return_dict_in_generate=True)
    for i, n in enumerate(PROMPT_LENGTHS):
        # draw prompts from the case's RNG stream until every greedy step is decided by a clear margin
        for attempt in range(MAX_PROMPT_DRAWS):
            prompt = rng.randint(0, V - 2, size=n)  # [0, V-3]
            ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
            with torch.no_grad(), Tracer() as tr:
                g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
            dlog = torch.stack([l[0].float() for l in g.logits])  # raw logits, [G, V]
            top2 = dlog.topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            if float(margin.min()) >= MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"no prompt of length {n} with greedy margins >= {MIN_MARGIN}")
        calls = tr.calls
        report["paths"][f"generate_{n}"] = {c: calls.count(c) for c in sorted(set(calls))}
        greedy = g.sequences[0, n:]
        assert greedy.shape[0] == G_STEPS
        assert torch.equal(dlog.argmax(-1), greedy), "greedy != argmax(raw logits)"
        report["min_margin"] = min(report["min_margin"], float(margin.min()))

        with torch.no_grad(), Tracer() as tr:
            out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
        report["paths"][f"forward_{n}"] = sorted(set(tr.calls))
        logits = out.logits[0].float()
        hidden = captured["norm_out"][0].float()
        assert torch.equal(captured["norm_out"], captured["head_in"]), "lm_head input != model.norm output"
        assert torch.allclose(hidden @ model.lm_head.weight.T, logits, atol=1e-4)
        hs_last = out.hidden_states[-1][0]
        report.setdefault("hidden_states_last_is_postnorm", []).append(bool(torch.allclose(hs_last, hidden)))

        # sanity: full forward over prompt + greedy[:-1] vs step-by-step decode logits
        full_ids = torch.cat([ids[0], greedy[:-1]])[None]
        with torch.no_grad():
            full = model(input_ids=full_ids, use_cache=False).logits[0, n - 1:].float()
        diff = float((full - dlog).abs().max())
        report["max_decode_vs_forward"] = max(report["max_decode_vs_forward"], diff)
        print(f"  prompt {i}: n={n:3d} draws={attempt + 1} greedy={greedy.tolist()} min_margin={float(margin.min()):.3f} "
              f"|forward - decode| max={diff:.2e}")

        ref[f"prompt_{i}"] = torch.tensor(prompt, dtype=torch.int32)
        ref[f"logits_{i}"] = logits.cpu().contiguous()
        ref[f"hidden_{i}"] = hidden.cpu().contiguous()
        ref[f"greedy_{i}"] = greedy.to(torch.int32).cpu().contiguous()
        ref[f"greedy_margin_{i}"] = margin.cpu().contiguous()
        ref[f"decode_logits_{i}"] = dlog.cpu().contiguous()
    h1.remove()
    h2.remove()

    mtp_sd = None
    if case["mtp"]:
        # the stored mtp.* values (storage dtype -> float32), exactly what an engine reads from the checkpoint
        mtp_sd = {n: t.float().to(device) for n, t in tensors.items() if n.startswith("mtp.")}
        assert sorted(mtp_sd) == sorted(mtp_shapes(case["text"])), sorted(mtp_sd)
        report["mtp_hf_batched_vs_cached"] = 0.0
        for i, n in enumerate(PROMPT_LENGTHS):
            ids = ref[f"prompt_{i}"].long().to(device)
            hid = ref[f"hidden_{i}"].to(device)
            with torch.no_grad():
                ml, mh = mtp_forward_hf(model, mtp_sd, cfg, ids, hid)
                ml2, mh2 = mtp_forward_hf(model, mtp_sd, cfg, ids, hid, incremental=True)
            assert ml.shape == (n - 1, V) and mh.shape == (n - 1, H)
            if n > 1:
                report["mtp_hf_batched_vs_cached"] = max(report["mtp_hf_batched_vs_cached"],
                                                         float((ml - ml2).abs().max()), float((mh - mh2).abs().max()))
            ref[f"mtp_logits_{i}"] = ml.float().cpu().contiguous()
            ref[f"mtp_hidden_{i}"] = mh.float().cpu().contiguous()
        print(f"  MTP (transformers layer) one causal pass vs DynamicCache row-by-row: max |diff| = "
              f"{report['mtp_hf_batched_vs_cached']:.2e}")
    # one metadata key only: safetensors serialises the metadata map in random order, which would break byte-identical
    # reruns
    save_file(ref, str(outdir / "reference.safetensors"), metadata={
        "generator": f"scripts/make_reference_fixtures.py transformers={transformers.__version__} device={device} "
                     f"greedy_steps={G_STEPS}"})

    # reload the written directory through transformers' own loader and compare
    report["reload_max_diff"] = reload_check(outdir, case, ref, device)
    print(f"  reload via from_pretrained: max |logits diff| = {report['reload_max_diff']:.2e}")

    if spec_check:
        sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
        md = 0.0
        mh = 0.0
        for i, n in enumerate(PROMPT_LENGTHS):
            with torch.no_grad():
                lg, hf = spec_forward(sd, cfg, ref[f"prompt_{i}"].long())
            md = max(md, float((lg - ref[f"logits_{i}"]).abs().max()))
            mh = max(mh, float((hf - ref[f"hidden_{i}"]).abs().max()))
        report["spec_max_diff_logits"] = md
        report["spec_max_diff_hidden"] = mh
        print(f"  independent spec implementation: max |logits diff| = {md:.2e}, |hidden diff| = {mh:.2e}")
        if mtp_sd is not None:
            msd = {k: v.cpu() for k, v in mtp_sd.items()}
            md = mh = 0.0
            for i, n in enumerate(PROMPT_LENGTHS):
                with torch.no_grad():
                    lg, hf = spec_mtp(sd, msd, cfg, ref[f"prompt_{i}"].long(), ref[f"hidden_{i}"])
                assert lg.shape == ref[f"mtp_logits_{i}"].shape and hf.shape == ref[f"mtp_hidden_{i}"].shape
                if n > 1:
                    md = max(md, float((lg - ref[f"mtp_logits_{i}"]).abs().max()))
                    mh = max(mh, float((hf - ref[f"mtp_hidden_{i}"]).abs().max()))
            report["spec_mtp_max_diff_logits"] = md
            report["spec_mtp_max_diff_hidden"] = mh
            print(f"  independent spec MTP implementation: max |mtp_logits diff| = {md:.2e}, "
                  f"|mtp_hidden diff| = {mh:.2e}")

    print(f"  code paths: {json.dumps(report['paths'])}")
    print(f"  output_hidden_states[-1] equals post-norm hidden: {report['hidden_states_last_is_postnorm']}")
    return report


def reload_check(outdir: Path, case: dict, ref: dict, device: str) -> float:
    import logging

    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if case["layout"] == "wrapper":
        m = Qwen3_5ForConditionalGeneration.from_pretrained(outdir, dtype=torch.float32, attn_implementation="eager")
    else:
        m = AutoModelForCausalLM.from_pretrained(outdir, dtype=torch.float32, attn_implementation="eager")
    m = m.eval().to(device)
    worst = 0.0
    for i in range(len(PROMPT_LENGTHS)):
        ids = ref[f"prompt_{i}"].long()[None].to(device)
        with torch.no_grad():
            lg = m(input_ids=ids, use_cache=False).logits[0].float().cpu()
        worst = max(worst, float((lg - ref[f"logits_{i}"]).abs().max()))
    transformers.logging.set_verbosity_warning()
    return worst


def describe(name: str, case: dict):
    tc = case["text"]
    cfg = text_config_for_hf(case)
    print(f"{name}: V={tc['vocab_size']} H={tc['hidden_size']} I={tc['intermediate_size']} "
          f"L={tc['num_hidden_layers']} layer_types={cfg.layer_types} nq/nkv={tc['num_attention_heads']}/"
          f"{tc['num_key_value_heads']} D={tc['head_dim']} rot={int(tc['head_dim'] * cfg.rope_parameters['partial_rotary_factor'])}"
          f" theta={cfg.rope_parameters['rope_theta']} Hk/Hv={tc['linear_num_key_heads']}/{tc['linear_num_value_heads']}"
          f" Dk/Dv={tc['linear_key_head_dim']}/{tc['linear_value_head_dim']} dtype={case['dtype']} tied={case['tied']}"
          f" layout={case['layout']} shards={case['shards']} mtp={case['mtp']}")


def summarize(outroot: Path, names):
    from safetensors import safe_open

    total = 0
    for name in names:
        d = outroot / name
        print(f"\n{d}:")
        for f in sorted(d.iterdir()):
            sz = f.stat().st_size
            total += sz
            print(f"  {f.name:45s} {sz:9d} B")
        with safe_open(str(d / "reference.safetensors"), "pt") as fh:
            for k in sorted(fh.keys()):
                t = fh.get_tensor(k)
                print(f"    {k:20s} {str(t.dtype):14s} {list(t.shape)}")
    print(f"\nfixtures total: {total} B ({total / 2**20:.2f} MiB)")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--no-spec-check", action="store_true", help="skip the independent spec implementation check")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}")
    if transformers.__version__ != "5.17.0":
        print("WARNING: fixtures were designed against transformers 5.17.0")
    print("GDN helper implementations resolved by transformers:")
    for k, v in gdn_impls().items():
        print(f"  {k}: {v}")
    for name in args.cases:
        describe(name, CASES[name])

    outroot = Path(args.out)
    reports = {}
    for name in args.cases:
        reports[name] = run_case(name, CASES[name], outroot, args.device, not args.no_spec_check)
    summarize(outroot, args.cases)
    print("\nsanity summary:")
    for name, r in reports.items():
        print(f"  {name}: decode-vs-forward {r['max_decode_vs_forward']:.2e}, reload {r['reload_max_diff']:.2e}, "
              f"spec {r.get('spec_max_diff_logits', float('nan')):.2e}, min greedy margin {r['min_margin']:.3f}"
              + (f", MTP spec {r.get('spec_mtp_max_diff_logits', float('nan')):.2e} (logits) "
                 f"{r.get('spec_mtp_max_diff_hidden', float('nan')):.2e} (hidden), MTP batched-vs-cached "
                 f"{r['mtp_hf_batched_vs_cached']:.2e}" if "mtp_hf_batched_vs_cached" in r else ""))


if __name__ == "__main__":
    main()
