#!/usr/bin/env python3
"""Builds tiny random Qwen3.5 checkpoints and records transformers' float32 reference outputs.

Usage
-----
    python3 scripts/make_reference_fixtures.py                 # writes tests/fixtures/<case>/ for all cases
    python3 scripts/make_reference_fixtures.py --cases causal_f16_interval2 --out /tmp/fx
    python3 scripts/make_reference_fixtures.py --cases moe_wrapper_fused_bf16 moe_causal_mtp_f32 moe_topk_ties
    python3 scripts/make_reference_fixtures.py --device cuda   # same fixtures, reference computed on a GPU
    python3 scripts/make_placeholder_model.py                  # the random placeholder models/default/ (separate script)

Requirements: scripts/requirements.txt (torch, transformers==5.17.0, safetensors, numpy). Runs on CPU in about two
minutes. Everything is deterministic: parameters are drawn from per-tensor seeded torch.Generators on the CPU (seed =
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
  moe_wrapper_fused_bf16      mixture-of-experts, official Qwen3.5-35B-A3B layout: Qwen3_5MoeForConditionalGeneration,
                              model_type qwen3_5_moe, text_config model_type qwen3_5_moe_text (vision_config model_type
                              qwen3_5_moe), keys model.language_model.*, 2 fake model.visual.* tensors, untied lm_head,
                              bf16, 2 shards + index, generation_config.json. V 384, H 64, 4 layers (layer_types AND
                              full_attention_interval 4, consistent: layer 3 full), nq 4 / nkv 2, D 32, rotary dim 8
                              (mrope_section [2,1,1]), Hk 2 / Hv 4, Dk = Dv = 32; E 8 experts, k 2,
                              moe_intermediate_size 32, shared_expert_intermediate_size 48. Trunk experts FUSED as
                              the official release stores them: model.language_model.layers.{l}.mlp.experts.gate_up_proj
                              [E, 2I, H] (rows [:I] gate, [I:] up) and .mlp.experts.down_proj [E, H, I], no ".weight"
                              suffix. MTP head (41 mtp.* tensors) with its experts PER EXPERT:
                              mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight.
  moe_causal_mtp_f32          mixture-of-experts, text-only layout (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text,
                              keys model.* + lm_head.weight), float32, single model.safetensors. V 128, H 32, 4 layers,
                              full_attention_interval 2 (no layer_types), nq 2 / nkv 1, D 32, rope theta 1e6 /
                              partial_rotary_factor 0.5 (rotary dim 16), Hk 2 / Hv 4, Dk = Dv = 16; E 6, k 3,
                              moe_intermediate_size 16, shared_expert_intermediate_size 24. Trunk experts PER EXPERT
                              exactly as transformers' save_pretrained writes them (model.layers.{l}.mlp.experts.{e}.
                              {gate,up,down}_proj.weight); MTP head (19 mtp.* tensors) with FUSED experts
                              (mtp.layers.0.mlp.experts.gate_up_proj / down_proj, as Qwen3.6 stores them).
  Every MoE layer (each trunk layer and mtp.layers.0) also has mlp.gate.weight [E, H] (router),
  mlp.shared_expert.{gate,up,down}_proj.weight and mlp.shared_expert_gate.weight [1, H]; no intermediate_size.
  moe_topk_ties               not a model: ties.safetensors, torch.topk tie-breaking on the CPU (see the end).

Every parameter is randomised explicitly (transformers would initialise the (1+w) norm weights to zero, which would
hide bugs), then rounded to the storage dtype and back, so the float32 reference model uses exactly the stored values:
  nn.Linear [out, in]  N(0, 1/in)  (o_proj / out_proj / down_proj times the case's out_gain; lm_head std 2/sqrt(H))
  embed_tokens N(0, 1); (1+w) norms (input/post_attention_layernorm, model.norm, q_norm, k_norm, mtp norms) N(0, 0.2^2);
  linear_attn.norm.weight (plain w) 1 + N(0, 0.2^2); A_log U(-1, 1.5); dt_bias N(0, 0.5^2); conv1d.weight N(0, 0.3^2).
  MoE: router mlp.gate.weight [E, H] and shared_expert_gate.weight [1, H] are nn.Linear-shaped (N(0, 1/H)); shared
  expert like a dense MLP (its down_proj times out_gain); fused experts gate_up_proj [E, 2I, H] N(0, 1/H) and
  down_proj [E, H, I] N(0, out_gain^2/I), drawn fused (one generator per fused tensor, canonical name
  "layers.{l}.mlp.experts.gate_up_proj" / "mtp.layers.0.mlp.experts.gate_up_proj") and split per expert for storage.

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
  MoE cases: the same tensors; prompts are redrawn (same stream) until, in addition, every router decision -- each
  trunk layer at every prompt position and decode step, and the MTP layer at every teacher-forced row -- has a gap
  >= MIN_ROUTER_GAP (1e-4) between the k-th and (k+1)-th largest router probability, so no near-tie makes the chosen
  experts fragile. The script prints how many tokens each expert got per layer (every expert is used in every layer)
  and the smallest gap per layer.
  Cases with an MTP head (wrapper_sharded_tied_bf16, causal_mtp_untied_f32, both moe_* cases) also have
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
  Qwen3_5RMSNorm / rotary embedding / causal mask with the stored mtp.* values loaded into them. MoE cases: the MTP
  layer is transformers' Qwen3_5MoeDecoderLayer (full attention + its sparse MoE block, eager experts) with the stored
  mtp.* values loaded (per-expert tensors fused into the module's gate_up_proj / down_proj).

MoE block (qwen35_arch.md §5; transformers Qwen3_5MoeSparseMoeBlock), per token h (post_attention_layernorm output):
  p = softmax_f32(h @ gate^T) over all E; (w, ids) = torch.topk(p, k); w /= sum(w) (always: transformers 5.17 has no
  norm_topk_prob switch -- a norm_topk_prob key in config.json is kept on the config but changes nothing);
  y = sum_j w_j * down_e(silu(gate_rows_e h) * up_rows_e h) + sigmoid(shared_expert_gate . h) * shared_expert(h).
  transformers' eager experts loop adds the expert outputs into zeros in increasing expert index, then the shared part.
  The reference runs with experts_implementation "eager" (transformers' per-expert F.linear loop, set through
  model.set_experts_implementation / from_pretrained(experts_implementation=...); a freshly built or loaded model
  defaults to "grouped_mm", and generate() on a GPU swaps grouped_mm for batched_mm). The script prints which function
  each experts call was dispatched to, and how far grouped_mm / batched_mm are from eager (~1e-5 on the logits).

Suggested tolerances for an fp32 engine: |logits diff| <= ~1e-4 * max(1, max|logit|) (transformers' own chunked-vs-
recurrent paths disagree by up to 1.9e-4 abs on the tied case, whose logits reach |35|; ~2e-5 on the others), hidden
~1e-4; greedy tokens exact (every step has margin >= 0.05). mtp_logits / mtp_hidden: the same tolerances (transformers'
MTP layer run as one causal pass vs row by row through its KV cache disagrees by up to 2.1e-5 on the tied case, whose
mtp_logits reach |39|; the independent spec implementation agrees to 2.4e-5 there, ~3e-6 on the F32 case).
MoE cases: the same tolerances (logits reach |~10|; transformers' forward-vs-decode paths disagree by up to 4.9e-5 on
moe_wrapper_fused_bf16 and 7.5e-6 on moe_causal_mtp_f32; the spec implementation agrees to 4.5e-5 / 2.6e-5 on the
logits, 5.7e-6 / 2.9e-6 on mtp_logits); the chosen experts must match exactly (router gaps >= 1e-4 everywhere).

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
MoE cases in addition: transformers' save_pretrained of the model writes exactly the per-expert tensors of
split_experts (same names and values); the reload through from_pretrained (Qwen3_5MoeForConditionalGeneration for the
wrapper, AutoModelForCausalLM -> Qwen3_5MoeForCausalLM for the text-only case, experts_implementation eager) reports no
missing text-model keys; spec_forward / spec_mtp compute the MoE block token by token from the spec (spec_moe).
transformers 5.17 loads both expert layouts in both model types (per-expert tensors are merged by its
qwen3_5_moe_text weight-conversion rule; fused tensors match the parameters directly); it ignores mtp.* on load.

moe_topk_ties/ties.safetensors: which experts torch.topk picks when router probabilities tie. On the CPU
(aten/src/ATen/native/TopKImpl.h) it fills (value, index) pairs and, with the comparator x.first > y.first (NaN
first), runs std::partial_sort over the first k when k * 64 <= n, else std::nth_element at k-1 followed by std::sort
of the first k-1 -- so ties are NOT resolved lowest-index-first (topk([0.1, .3, .3, .3, 0], 2) gives indices [1, 3]).
For each (n, k) in TIES_SHAPES ((4,2) (6,3) (8,2) (16,4) (64,8) (128,2)* (256,8) (512,8)* (512,10) (600,8)*
(1024,8)*; * = partial_sort branch), 32 rows:
  probs_{n}_{k}    float32 [32, n]  softmax of float32 logits drawn from a few distinct levels (exactly equal
                                    probabilities within a level): all-equal rows, one-off rows, more than k tied
                                    maxima, ties straddling the k boundary, tails underflowing to exactly 0.0 with
                                    fewer than k non-zeros, rows of 2..6 random levels
  indices_{n}_{k}  int32   [32, k]  torch.topk(probs, k, dim=-1).indices (largest, sorted, as the router calls it)
  values_{n}_{k}   float32 [32, k]  torch.topk(probs, k, dim=-1).values
A C++ replay of that loop with libstdc++ (g++ 12) reproduces every row.
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
    # ---- mixture-of-experts (qwen3_5_moe) cases: every layer's MLP (and the MTP layer's) is a sparse MoE block ----
    "moe_wrapper_fused_bf16": dict(
        seed=5005,
        dtype="bf16",
        layout="wrapper",
        out_gain=2.0,
        shards=2,
        tied=False,
        mtp=True,
        trunk_experts="fused",  # model.language_model.layers.{l}.mlp.experts.{gate_up_proj,down_proj} (official)
        mtp_experts="per_expert",  # mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight (official Qwen3.5 MTP)
        text={
            "vocab_size": 384,
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "full_attention_interval": 4,  # both keys, consistent, as in the official configs
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 4096,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "output_gate_type": "swish",
            "partial_rotary_factor": 0.25,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_interleaved": True,
                "mrope_section": [2, 1, 1],  # sums to rotary_dim / 2 = 32 * 0.25 / 2 = 4
            },
            "tie_word_embeddings": False,
            "use_cache": True,
            "dtype": "bfloat16",
            "bos_token_id": 383,
            "eos_token_id": 383,
        },
    ),
    "moe_causal_mtp_f32": dict(
        seed=6006,
        dtype="f32",
        layout="causal",
        shards=1,
        tied=False,
        mtp=True,
        trunk_experts="per_expert",  # model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight (save_pretrained)
        mtp_experts="fused",  # mtp.layers.0.mlp.experts.{gate_up_proj,down_proj} (Qwen3.6)
        text={
            "vocab_size": 128,
            "hidden_size": 32,
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
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.5,
            },
            "tie_word_embeddings": False,
            "dtype": "float32",
        },
    ),
}

MOE_TIES_NAME = "moe_topk_ties"  # pseudo-case: tests/fixtures/moe_topk_ties/ties.safetensors (torch.topk tie-breaking)
MIN_ROUTER_GAP = 1e-4  # MoE prompts are also redrawn until every router's k-th minus (k+1)-th probability >= this

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
    if name.endswith("mlp.experts.gate_up_proj"):  # MoE experts, fused [E, 2I, H]: per expert an nn.Linear [2I, H]
        return normal(1.0 / math.sqrt(shape[2]))
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]: writes into the residual stream
        return normal(out_gain / math.sqrt(shape[2]))
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


def is_moe(case_or_tc: dict) -> bool:
    return "num_experts" in case_or_tc.get("text", case_or_tc)


def mtp_shapes(tc: dict) -> dict:
    """Canonical mtp.* shapes; for MoE the experts are listed FUSED (the module's parameters); storage_experts()
    turns them into the case's on-disk naming."""
    H, D = tc["hidden_size"], tc["head_dim"]
    nq, nkv = tc["num_attention_heads"], tc["num_key_value_heads"]
    if is_moe(tc):
        E, I, Ish = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
        mlp = {
            "mtp.layers.0.mlp.gate.weight": (E, H),
            "mtp.layers.0.mlp.experts.gate_up_proj": (E, 2 * I, H),
            "mtp.layers.0.mlp.experts.down_proj": (E, H, I),
            "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (Ish, H),
            "mtp.layers.0.mlp.shared_expert.up_proj.weight": (Ish, H),
            "mtp.layers.0.mlp.shared_expert.down_proj.weight": (H, Ish),
            "mtp.layers.0.mlp.shared_expert_gate.weight": (1, H),
        }
    else:
        inter = tc["intermediate_size"]
        mlp = {
            "mtp.layers.0.mlp.gate_proj.weight": (inter, H),
            "mtp.layers.0.mlp.up_proj.weight": (inter, H),
            "mtp.layers.0.mlp.down_proj.weight": (H, inter),
        }
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
        **mlp,
    }


def mtp_tensors(tc: dict, seed: int, dtype: torch.dtype, out_gain: float = 1.0) -> dict:
    return {n: random_tensor(n, s, seed, tc["hidden_size"], out_gain).to(dtype) for n, s in mtp_shapes(tc).items()}


FUSED_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def split_experts(tensors: dict) -> dict:
    """Fused MoE experts -> per-expert tensors, exactly as transformers' save_pretrained writes them:
    X.mlp.experts.gate_up_proj [E, 2I, H] -> X.mlp.experts.{e}.gate_proj.weight = [e, :I], .up_proj.weight = [e, I:];
    X.mlp.experts.down_proj [E, H, I] -> X.mlp.experts.{e}.down_proj.weight = [e]. Other tensors pass through; the
    order of the dict is kept (each fused tensor is replaced in place by its per-expert tensors)."""
    out = {}
    for n, t in tensors.items():
        if n.endswith(".mlp.experts.gate_up_proj"):
            base, I = n[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :I].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, I:].contiguous()
        elif n.endswith(".mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[n] = t
    return out


def fuse_experts(tensors: dict) -> dict:
    """Inverse of split_experts: per-expert X.mlp.experts.{e}.{gate,up,down}_proj.weight -> the module's fused
    parameters X.mlp.experts.gate_up_proj (gate rows first, then up rows) / X.mlp.experts.down_proj."""
    import re

    pat = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")
    groups, out = {}, {}
    for n, t in tensors.items():
        m = pat.match(n)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[n] = t
    for base, g in groups.items():
        E = 1 + max(e for e, _ in g)
        assert sorted(g) == sorted((e, w) for e in range(E) for w in ("gate", "up", "down")), base
        out[base + "gate_up_proj"] = torch.stack([torch.cat([g[(e, "gate")], g[(e, "up")]], 0) for e in range(E)])
        out[base + "down_proj"] = torch.stack([g[(e, "down")] for e in range(E)])
    return out


def storage_experts(tensors: dict, style: str) -> dict:
    """Canonical (fused) MoE expert tensors -> the on-disk style: "fused" (unchanged) or "per_expert"."""
    if style == "fused":
        return dict(tensors)
    assert style == "per_expert", style
    return split_experts(tensors)


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
    moe = is_moe(case)
    if case["layout"] == "wrapper":
        V = tc["vocab_size"]
        text = {"model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", **tc}
        vision = dict(VISION_CONFIG, out_hidden_size=tc["hidden_size"])
        if moe:
            vision["model_type"] = "qwen3_5_moe"  # as in the official MoE checkpoints (remapped to qwen3_5_moe_vision)
        return {
            "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text,
            "vision_config": vision,
            "tie_word_embeddings": case["tied"],
            "image_token_id": V - 6,
            "video_token_id": V - 5,
            "vision_start_token_id": V - 4,
            "vision_end_token_id": V - 3,
            "language_model_only": False,
            "transformers_version": "5.17.0",
        }
    if moe:
        return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", **tc,
                "transformers_version": "5.17.0"}
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **tc,
            "transformers_version": "5.17.0"}


EXPERTS_IMPL = "eager"  # transformers' per-expert loop (F.linear per chosen expert): the most exact in float32


def text_config_for_hf(case: dict):
    """Qwen3_5TextConfig (Qwen3_5MoeTextConfig for MoE cases) built from the same values that are written to
    config.json."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    tc = copy.deepcopy(case["text"])
    tc.pop("dtype", None)
    cfg = (Qwen3_5MoeTextConfig if is_moe(case) else Qwen3_5TextConfig)(**tc)
    cfg._attn_implementation = "eager"
    if is_moe(case):
        cfg._experts_implementation = EXPERTS_IMPL
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
    if is_moe(case):  # the module holds fused experts; write them as the case stores them
        tensors = storage_experts(tensors, case["trunk_experts"])
    for out_name in tensors:
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
        mt = mtp_tensors(case["text"], seed, dtype, case.get("out_gain", 1.0))
        if is_moe(case):
            mt = storage_experts(mt, case["mtp_experts"])
        for n, t in mt.items():
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
        if getattr(cfg, "num_experts", None):
            x = x + torch.stack([spec_moe(h[t], sd, m, cfg) for t in range(T)])
        else:
            x = x + (F.silu(h @ W(m + "gate_proj.weight").T) * (h @ W(m + "up_proj.weight").T)) @ W(
                m + "down_proj.weight").T
    hfin = rms1p(x, W("model.norm.weight"))
    head = sd.get("lm_head.weight", W("model.embed_tokens.weight"))
    return hfin @ head.T, hfin


def spec_moe(h: torch.Tensor, sd: dict, p: str, cfg) -> torch.Tensor:
    """Sparse MoE block of qwen35_arch.md §5 for ONE token h [H], float32, written from the spec: router softmax over
    all E experts, the k largest probabilities (a plain sort; ties cannot matter: prompts are drawn so that the k-th and
    (k+1)-th probabilities differ by >= MIN_ROUTER_GAP), renormalised to sum 1, a loop over the chosen experts
    (gate rows [:I] / up rows [I:] of the fused gate_up_proj), plus the always-on shared expert scaled by
    sigmoid(shared_expert_gate . h). p: the "...mlp." prefix of the layer's tensors in sd (fused expert names)."""
    E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    probs = torch.softmax(sd[p + "gate.weight"] @ h, dim=0)
    ids = sorted(range(E), key=lambda e: -float(probs[e]))[:k]
    w = probs[ids] / probs[ids].sum()
    y = torch.zeros_like(h)
    for j, e in enumerate(ids):
        gu = sd[p + "experts.gate_up_proj"][e]  # [2I, H]
        a = F.silu(gu[:I] @ h) * (gu[I:] @ h)
        y = y + w[j] * (sd[p + "experts.down_proj"][e] @ a)
    sh = F.silu(sd[p + "shared_expert.gate_proj.weight"] @ h) * (sd[p + "shared_expert.up_proj.weight"] @ h)
    y = y + torch.sigmoid(sd[p + "shared_expert_gate.weight"] @ h)[0] * (sd[p + "shared_expert.down_proj.weight"] @ sh)
    return y


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
                   incremental: bool = False, on_layer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced MTP pass built from transformers modules. model: the float32 Qwen3_5ForCausalLM (shared
    embed_tokens / lm_head / rotary_emb); mtp_sd: {"mtp.*": float32 tensor} (the stored values; MoE experts fused as
    the module's parameters); ids [n] long; hidden [n, H] = trunk post-final-norm hidden. Returns (logits [n-1, V],
    mtp hidden [n-1, H]). MoE configs (Qwen3_5MoeForCausalLM model) use Qwen3_5MoeDecoderLayer (its sparse MoE MLP,
    experts implementation cfg._experts_implementation) / Qwen3_5MoeRMSNorm instead.

    incremental=False: one causal pass over all n-1 rows (eager attention, transformers' create_causal_mask).
    incremental=True: one row at a time through a DynamicCache (the MTP layer's own KV cache).
    on_layer: optional callback(layer) run on the built decoder layer (e.g. to hook its router)."""
    from transformers.cache_utils import DynamicCache
    from transformers.masking_utils import create_causal_mask

    if getattr(cfg, "num_experts", None):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Qwen3_5DecoderLayer
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm as Qwen3_5RMSNorm
    else:
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
    if on_layer is not None:
        on_layer(layer)

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
        if getattr(cfg, "num_experts", None):
            u = u + spec_moe(x, mtp_sd, "mtp." + f, cfg)
        else:
            u = u + (F.silu(x @ M(f + "gate_proj.weight").T) * (x @ M(f + "up_proj.weight").T)) @ M(
                f + "down_proj.weight").T
        m = rms1p(u, M("norm.weight"))
        outs.append(m)
        logits.append(m @ head.T)
    if not outs:
        return torch.zeros(0, V), torch.zeros(0, H)
    return torch.stack(logits), torch.stack(outs)


# ---------------------------------------------------------------------------------------------------------------
# Reference computation
# ---------------------------------------------------------------------------------------------------------------


def modeling_module(moe: bool = False):
    if moe:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    else:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    return m


def gdn_impls(moe: bool = False) -> dict:
    """Which implementation transformers resolved for the GDN helper functions."""
    import transformers.integrations.hub_kernels as hk

    m = modeling_module(moe)

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

    def __init__(self, moe: bool = False):
        self.calls = []
        self._orig = {}
        self._m = modeling_module(moe)

    def __enter__(self):
        m = self._m
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
        for fname, orig in self._orig.items():
            setattr(self._m, fname, orig)


class ExpertsTracer:
    """Records which function transformers' ExpertsInterface dispatched each MoE experts forward to."""

    def __init__(self):
        self.resolved = {}

    def __enter__(self):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as A

        orig = type(A).get_interface

        def wrapped(impl, default):
            f = orig(A, impl, default)
            key = f"{impl} -> {f.__module__}.{f.__qualname__}"
            self.resolved[key] = self.resolved.get(key, 0) + 1
            return f

        A.get_interface = wrapped  # instance attribute shadows the class method
        return self

    def __exit__(self, *exc):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as A

        del A.get_interface


class RouterRecorder:
    """Forward hooks on MoE routers (Qwen3_5MoeTopKRouter, whose forward returns (router_logits, weights, indices)):
    the smallest gap between the k-th and (k+1)-th router probability seen (where a near-tie would make the choice of
    experts fragile), and per layer how many tokens each expert got (while `counting`)."""

    def __init__(self, E: int, k: int):
        self.E, self.k = E, k
        self.counts = {}  # layer -> LongTensor [E], accepted prompts only
        self.min_gap_total = float("inf")
        self.gaps_total = {}  # layer -> min gap over accepted prompts
        self.start_attempt()

    def start_attempt(self):
        self.counting = True
        self.att_counts = {}
        self.att_gaps = {}

    @property
    def attempt_min_gap(self) -> float:
        return min(self.att_gaps.values(), default=float("inf"))

    def accept(self):
        for l, c in self.att_counts.items():
            self.counts[l] = self.counts.get(l, torch.zeros(self.E, dtype=torch.long)) + c
        for l, g in self.att_gaps.items():
            self.gaps_total[l] = min(self.gaps_total.get(l, float("inf")), g)
        self.min_gap_total = min(self.gaps_total.values(), default=float("inf"))

    def attach(self, router, layer: str):
        def hook(mod, inp, out):
            logits, _, idx = out
            probs = torch.softmax(logits.detach().float(), dim=-1)  # the router's own softmax is float32 too
            top = probs.topk(self.k + 1, dim=-1).values
            gap = float((top[:, self.k - 1] - top[:, self.k]).min())
            self.att_gaps[layer] = min(self.att_gaps.get(layer, float("inf")), gap)
            if self.counting:
                c = torch.bincount(idx.detach().flatten().cpu(), minlength=self.E)
                self.att_counts[layer] = self.att_counts.get(layer, torch.zeros(self.E, dtype=torch.long)) + c

        return router.register_forward_hook(hook)


def run_case(name: str, case: dict, outroot: Path, device: str, spec_check: bool) -> dict:
    import transformers
    from safetensors.torch import save_file
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

    print(f"\n=== {name} ===")
    dtype = DTYPES[case["dtype"]]
    seed = case["seed"]
    moe = is_moe(case)
    torch.manual_seed(seed)
    cfg = text_config_for_hf(case)
    check_rope(cfg, case)
    V, H = cfg.vocab_size, cfg.hidden_size
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(cfg)
    randomize_model(model, seed, dtype, H, case.get("out_gain", 1.0))
    if case["tied"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tie failed"
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    model = model.float().eval().to(device)
    if moe:
        model.set_experts_implementation(EXPERTS_IMPL)
        assert model.config._experts_implementation == EXPERTS_IMPL, model.get_experts_implementation()

    outdir = outroot / name
    tensors, shard_of = checkpoint_tensors(model, case, dtype)
    write_checkpoint(outdir, case, tensors, shard_of)
    if case["layout"] == "wrapper":
        V_ = V
        gen = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95, "eos_token_id": [V_ - 2, V_ - 1],
               "bos_token_id": V_ - 1, "pad_token_id": V_ - 1, "transformers_version": "5.17.0"}
        (outdir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    report = {"paths": {}, "max_decode_vs_forward": 0.0, "min_margin": float("inf")}
    if moe:
        report["save_pretrained_naming"] = check_save_pretrained_naming(model, tensors, case, dtype)

    mtp_sd = None
    if case["mtp"]:
        # the stored mtp.* values (storage dtype -> float32), exactly what an engine reads from the checkpoint; MoE
        # experts converted to the decoder layer's fused parameters when they are stored per expert
        stored = {n: t for n, t in tensors.items() if n.startswith("mtp.")}
        expect = mtp_shapes(case["text"])
        if moe:
            expect = storage_experts({n: torch.empty(sh) for n, sh in expect.items()}, case["mtp_experts"])
            expect = {n: tuple(t.shape) for n, t in expect.items()}
        assert {n: tuple(t.shape) for n, t in stored.items()} == expect, sorted(stored)
        mtp_sd = {n: t.float().to(device) for n, t in (fuse_experts(stored) if moe else stored).items()}
        assert sorted(mtp_sd) == sorted(mtp_shapes(case["text"])), sorted(mtp_sd)

    # hooks: model.norm output and lm_head input must agree
    captured = {}
    h1 = model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("norm_out", o.detach()))
    h2 = model.lm_head.register_forward_pre_hook(lambda m, i: captured.__setitem__("head_in", i[0].detach()))
    rec, rhandles = None, []
    if moe:
        rec = RouterRecorder(cfg.num_experts, cfg.num_experts_per_tok)
        for mname, mod in model.named_modules():
            if mname.endswith(".mlp.gate"):
                rhandles.append(rec.attach(mod, mname[len("model."):-len(".mlp.gate")]))
        assert len(rhandles) == cfg.num_hidden_layers

        def hook_mtp(layer):
            rhandles.append(rec.attach(layer.mlp.gate, "mtp.layers.0"))

    rng = np.random.RandomState(seed)
    ref = {}
    from transformers import GenerationConfig

    gcfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=G_STEPS, min_new_tokens=G_STEPS,
                            eos_token_id=None, bos_token_id=None, pad_token_id=0, use_cache=True,
                            output_logits=True, output_scores=True, return_dict_in_generate=True)
    experts_tr = ExpertsTracer()
    for i, n in enumerate(PROMPT_LENGTHS):
        # draw prompts from the case's RNG stream until every greedy step is decided by a clear margin (MoE: and every
        # router choice, trunk layers and MTP layer, by a clear k-th vs (k+1)-th probability gap)
        for attempt in range(MAX_PROMPT_DRAWS):
            prompt = rng.randint(0, V - 2, size=n)  # [0, V-3]
            ids = torch.tensor(prompt, dtype=torch.long, device=device)[None]
            if rec is not None:
                rec.start_attempt()
            with torch.no_grad(), Tracer(moe) as tr, experts_tr:
                g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gcfg)
            dlog = torch.stack([l[0].float() for l in g.logits])  # raw logits, [G, V]
            top2 = dlog.topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            if float(margin.min()) < MIN_MARGIN:
                continue
            if rec is None:
                break
            # MoE: the routers of the no-cache forwards (the prompt; prompt + greedy[:-1]) and of the MTP pass
            rec.counting = False
            with torch.no_grad():
                model(input_ids=torch.cat([ids[0], g.sequences[0, n:-1]])[None], use_cache=False)
                model(input_ids=ids, use_cache=False)  # leaves the prompt's post-norm hidden in captured["norm_out"]
                rec.counting = True
                if mtp_sd is not None:
                    mtp_forward_hf(model, mtp_sd, cfg, ids[0], captured["norm_out"][0].float(), on_layer=hook_mtp)
            if rec.attempt_min_gap >= MIN_ROUTER_GAP:
                rec.accept()
                break
        else:
            raise RuntimeError(f"no prompt of length {n} with greedy margins >= {MIN_MARGIN}"
                               + (f" and router gaps >= {MIN_ROUTER_GAP}" if moe else ""))
        calls = tr.calls
        report["paths"][f"generate_{n}"] = {c: calls.count(c) for c in sorted(set(calls))}
        greedy = g.sequences[0, n:]
        assert greedy.shape[0] == G_STEPS
        assert torch.equal(dlog.argmax(-1), greedy), "greedy != argmax(raw logits)"
        report["min_margin"] = min(report["min_margin"], float(margin.min()))

        with torch.no_grad(), Tracer(moe) as tr, experts_tr:
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
              f"|forward - decode| max={diff:.2e}"
              + (f" min router gap={rec.attempt_min_gap:.2e}" if rec is not None else ""))

        ref[f"prompt_{i}"] = torch.tensor(prompt, dtype=torch.int32)
        ref[f"logits_{i}"] = logits.cpu().contiguous()
        ref[f"hidden_{i}"] = hidden.cpu().contiguous()
        ref[f"greedy_{i}"] = greedy.to(torch.int32).cpu().contiguous()
        ref[f"greedy_margin_{i}"] = margin.cpu().contiguous()
        ref[f"decode_logits_{i}"] = dlog.cpu().contiguous()
    h1.remove()
    h2.remove()
    for hd in rhandles:
        hd.remove()

    if mtp_sd is not None:
        report["mtp_hf_batched_vs_cached"] = 0.0
        for i, n in enumerate(PROMPT_LENGTHS):
            ids = ref[f"prompt_{i}"].long().to(device)
            hid = ref[f"hidden_{i}"].to(device)
            with torch.no_grad(), experts_tr:
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
    if moe:
        report["experts_impl"] = dict(experts_tr.resolved)
        print(f"  experts implementation dispatched (calls): {json.dumps(report['experts_impl'])}")
        assert all(k.startswith(f"{EXPERTS_IMPL} -> ") for k in experts_tr.resolved), experts_tr.resolved
        report["router_min_gap"] = rec.min_gap_total
        print(f"  router: k={cfg.num_experts_per_tok} of E={cfg.num_experts}; tokens per expert (generate: prompt + "
              f"{G_STEPS - 1} decode steps; MTP: its n-1 rows; all 3 prompts) and min k-th vs (k+1)-th probability "
              f"gap:")
        for layer, c in rec.counts.items():
            print(f"    {layer:14s} {c.tolist()}  min gap {rec.gaps_total[layer]:.2e}")
            assert int((c == 0).sum()) == 0, f"{name}: an expert of {layer} is never chosen: {c.tolist()}"
        print(f"  router min gap over every layer, prompt, decode step and the MTP rows: {rec.min_gap_total:.2e}")
        report["other_experts_impls"] = compare_experts_impls(model, ref, device)
    # one metadata key only: safetensors serialises the metadata map in random order, which would break byte-identical
    # reruns
    save_file(ref, str(outdir / "reference.safetensors"), metadata={
        "generator": f"scripts/make_reference_fixtures.py transformers={transformers.__version__} device={device} "
                     f"greedy_steps={G_STEPS}" + (f" experts_implementation={EXPERTS_IMPL}" if moe else "")})

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


def check_save_pretrained_naming(model, tensors: dict, case: dict, dtype: torch.dtype) -> str:
    """MoE: transformers' own save_pretrained (per-expert names) vs this script's trunk tensors turned per-expert with
    split_experts (same names, same values once rounded to the storage dtype)."""
    from safetensors.torch import load_file

    mine = {}
    for n, t in split_experts(tensors).items():
        if n.startswith(("mtp.", "model.visual.")):
            continue
        mine[n.replace("model.language_model.", "model.", 1)] = t
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        files = sorted(Path(d).glob("*.safetensors"))
        theirs = {}
        for f in files:
            theirs.update(load_file(str(f)))
    assert sorted(theirs) == sorted(mine), (sorted(set(theirs) ^ set(mine)))[:10]
    bad = [n for n in mine if not torch.equal(theirs[n].to(dtype), mine[n])]
    assert not bad, bad[:10]
    per_expert = sum(".mlp.experts." in n for n in theirs)
    msg = f"{len(theirs)} tensors ({per_expert} per-expert) identical to split_experts(trunk)"
    print(f"  save_pretrained (transformers' own writer): {msg}")
    return msg


def compare_experts_impls(model, ref: dict, device: str) -> dict:
    """Informational: logits of the longest prompt with transformers' other experts implementations vs the eager
    reference (then switches back to eager)."""
    out = {}
    ids = ref[f"prompt_{len(PROMPT_LENGTHS) - 1}"].long()[None].to(device)
    for impl in ("grouped_mm", "batched_mm"):
        try:
            model.set_experts_implementation(impl)
            with torch.no_grad(), ExpertsTracer() as et:
                lg = model(input_ids=ids, use_cache=False).logits[0].float().cpu()
            out[impl] = float((lg - ref[f"logits_{len(PROMPT_LENGTHS) - 1}"]).abs().max())
            print(f"  experts implementation {impl} ({', '.join(et.resolved)}): max |logits - eager| = {out[impl]:.2e}")
        except Exception as e:  # noqa: BLE001 (informational only)
            out[impl] = f"unavailable: {type(e).__name__}: {e}"
            print(f"  experts implementation {impl}: {out[impl]}")
    model.set_experts_implementation(EXPERTS_IMPL)
    assert model.config._experts_implementation == EXPERTS_IMPL
    return out


def reload_check(outdir: Path, case: dict, ref: dict, device: str) -> float:
    import logging

    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if is_moe(case):
        cls = Qwen3_5MoeForConditionalGeneration if case["layout"] == "wrapper" else AutoModelForCausalLM
        m, info = cls.from_pretrained(outdir, dtype=torch.float32, attn_implementation="eager",
                                      experts_implementation=EXPERTS_IMPL, output_loading_info=True)
        if case["layout"] == "causal":
            assert isinstance(m, Qwen3_5MoeForCausalLM), type(m)
        # everything of the text model must come from the file (the wrapper's vision tower is not in it)
        missing = [k for k in info["missing_keys"] if "visual" not in k]
        assert not missing and not info.get("mismatched_keys"), (missing, info.get("mismatched_keys"))
        assert m.config.get_text_config()._experts_implementation == EXPERTS_IMPL
    elif case["layout"] == "wrapper":
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


# ---------------------------------------------------------------------------------------------------------------
# torch.topk tie-breaking fixture (tests/fixtures/moe_topk_ties/ties.safetensors)
# ---------------------------------------------------------------------------------------------------------------

# (n, k): k*64 <= n -> std::partial_sort branch (128/2, 512/8, 600/8, 1024/8), else std::nth_element + std::sort
TIES_SHAPES = ((4, 2), (6, 3), (8, 2), (16, 4), (64, 8), (128, 2), (256, 8), (512, 8), (512, 10), (600, 8), (1024, 8))
TIES_ROWS = 32
TIES_SEED = 7007


def ties_rows(n: int, k: int, rs: np.random.RandomState) -> np.ndarray:
    """TIES_ROWS float32 logit rows [rows, n] drawn from a few distinct levels, so that softmax gives exactly equal
    probabilities within a level (same exp, same sum): all-equal rows, one-off rows, more than k tied maxima, ties that
    straddle the k boundary (j < k distinct larger values, then m tied values with j < k < j + m), rows whose tail
    underflows to exactly 0.0 with fewer than k non-zeros, and rows of 2..6 random levels."""
    rows = []

    def levels(count):  # distinct, decreasing, softmax-like spacing
        return np.sort(rs.choice(np.arange(-24, 9) * 0.375, size=count, replace=False))[::-1].astype(np.float32)

    rows.append(np.zeros(n, np.float32))  # all equal
    r = np.full(n, -1.0, np.float32)
    r[rs.randint(n)] = 0.5
    rows.append(r)  # all equal but one larger
    r = np.zeros(n, np.float32)
    r[rs.randint(n)] = -2.0
    rows.append(r)  # all equal but one smaller
    for m in (k + 1, min(n, 2 * k + 1), min(n, k + 1 + rs.randint(max(1, n - k)))):  # more than k tied maxima
        lv = levels(3)
        r = rs.choice(lv[1:], size=n)
        r[rs.choice(n, size=m, replace=False)] = lv[0]
        rows.append(r)
    for j in [0, k - 1, max(0, k - 2), min(1, k - 1)] + [int(rs.randint(k)) for _ in range(4)]:
        # straddling ties: j distinct values above the boundary, then m >= k - j + 1 tied values (j < k < j + m)
        m = k - j + 1 + rs.randint(min(n - k - 1, 2 * k) + 1)
        lv = levels(j + 2)
        perm = rs.permutation(n)
        r = np.full(n, lv[-1], np.float32)
        r[perm[:j]] = lv[:j]
        r[perm[j:j + m]] = lv[j]
        rows.append(r)
    for nz in (max(1, k - 1), 1):  # tail underflows: exp(-200) == 0.0 in float32 -> zeros tie across the boundary
        r = np.full(n, -200.0, np.float32)
        r[rs.choice(n, size=nz, replace=False)] = rs.choice([0.0, 0.25], size=nz)
        rows.append(r)
    while len(rows) < TIES_ROWS:  # rows of few random levels
        lv = levels(2 + len(rows) % 5)
        rows.append(rs.choice(lv, size=n))
    return np.stack(rows).astype(np.float32)


def make_topk_ties(outdir: Path):
    """Writes ties.safetensors: per (n, k) probs_{n}_{k} float32 [rows, n] (softmax rows with exact ties),
    indices_{n}_{k} int32 [rows, k] and values_{n}_{k} float32 [rows, k] = torch.topk(probs, k, dim=-1) on the CPU
    (largest=True, sorted=True, as Qwen3_5MoeTopKRouter calls it)."""
    import transformers
    from safetensors.torch import save_file

    print(f"\n=== {MOE_TIES_NAME} ===")
    rs = np.random.RandomState(TIES_SEED)
    out = {}
    for n, k in TIES_SHAPES:
        probs = torch.softmax(torch.from_numpy(ties_rows(n, k, rs)), dim=-1)
        assert probs.dtype == torch.float32 and probs.is_contiguous()
        vals, idx = torch.topk(probs, k, dim=-1)
        for r in range(probs.shape[0]):  # the same answer row by row (1-D calls)
            v1, i1 = torch.topk(probs[r], k)
            assert torch.equal(i1, idx[r]) and torch.equal(v1, vals[r])
        # how often torch's choice differs from "ties -> lowest index first" (the rows are built for that)
        low = torch.stack([torch.tensor(sorted(range(n), key=lambda e: (-float(p[e]), e))[:k]) for p in probs])
        diff_order = int((low != idx).any(-1).sum())
        diff_set = sum(set(low[r].tolist()) != set(idx[r].tolist()) for r in range(probs.shape[0]))
        straddle = int(sum(float(vals[r, -1]) == float(torch.sort(probs[r], descending=True).values[k])
                           for r in range(probs.shape[0])) if k < n else 0)
        branch = "partial_sort" if k * 64 <= n else "nth_element+sort"
        print(f"  n={n:5d} k={k:3d} ({branch:16s}): {probs.shape[0]} rows, {straddle} with a tie across the k "
              f"boundary; "
              f"torch.topk != lowest-index-first in {diff_order} rows (order), {diff_set} rows (chosen set)")
        out[f"probs_{n}_{k}"] = probs.contiguous()
        out[f"indices_{n}_{k}"] = idx.to(torch.int32).contiguous()
        out[f"values_{n}_{k}"] = vals.contiguous()
    d = outdir / MOE_TIES_NAME
    d.mkdir(parents=True, exist_ok=True)
    save_file(out, str(d / "ties.safetensors"), metadata={
        "generator": f"scripts/make_reference_fixtures.py torch={torch.__version__} "
                     f"transformers={transformers.__version__} device=cpu torch.topk(probs, k, dim=-1)"})


def describe(name: str, case: dict):
    tc = case["text"]
    cfg = text_config_for_hf(case)
    mlp = (f"MoE E={tc['num_experts']} k={tc['num_experts_per_tok']} I={tc['moe_intermediate_size']} "
           f"I_shared={tc['shared_expert_intermediate_size']} experts trunk/mtp={case['trunk_experts']}/"
           f"{case.get('mtp_experts')}" if is_moe(case) else f"I={tc['intermediate_size']}")
    print(f"{name}: V={tc['vocab_size']} H={tc['hidden_size']} {mlp} "
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
        ref = d / ("ties.safetensors" if name == MOE_TIES_NAME else "reference.safetensors")
        with safe_open(str(ref), "pt") as fh:
            for k in sorted(fh.keys()):
                t = fh.get_tensor(k)
                print(f"    {k:20s} {str(t.dtype):14s} {list(t.shape)}")
    print(f"\nfixtures total: {total} B ({total / 2**20:.2f} MiB)")
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
    ap.add_argument("--cases", nargs="*", default=list(CASES) + [MOE_TIES_NAME],
                    help=f"any of {list(CASES) + [MOE_TIES_NAME]} (default: all)")
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
    unknown = [c for c in args.cases if c not in CASES and c != MOE_TIES_NAME]
    if unknown:
        ap.error(f"unknown case(s) {unknown}")
    if any(is_moe(CASES[c]) for c in args.cases if c in CASES):
        print("GDN helper implementations resolved by transformers (qwen3_5_moe):")
        for k, v in gdn_impls(moe=True).items():
            print(f"  {k}: {v}")
    for name in args.cases:
        if name in CASES:
            describe(name, CASES[name])

    outroot = Path(args.out)
    reports = {}
    for name in args.cases:
        if name == MOE_TIES_NAME:
            make_topk_ties(outroot)
        else:
            reports[name] = run_case(name, CASES[name], outroot, args.device, not args.no_spec_check)
    summarize(outroot, args.cases)
    print("\nsanity summary:")
    for name, r in reports.items():
        print(f"  {name}: decode-vs-forward {r['max_decode_vs_forward']:.2e}, reload {r['reload_max_diff']:.2e}, "
              f"spec {r.get('spec_max_diff_logits', float('nan')):.2e}, min greedy margin {r['min_margin']:.3f}"
              + (f", MTP spec {r.get('spec_mtp_max_diff_logits', float('nan')):.2e} (logits) "
                 f"{r.get('spec_mtp_max_diff_hidden', float('nan')):.2e} (hidden), MTP batched-vs-cached "
                 f"{r['mtp_hf_batched_vs_cached']:.2e}" if "mtp_hf_batched_vs_cached" in r else "")
              + (f", min router gap {r['router_min_gap']:.2e}, experts {list(r['experts_impl'])}, other experts "
                 f"implementations vs eager {r['other_experts_impls']}" if "router_min_gap" in r else ""))


if __name__ == "__main__":
    main()
