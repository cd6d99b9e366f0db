#!/usr/bin/env python3
"""Builds the random-weight placeholder default model in models/default/ (shipped until a trained model lands).

Usage
-----
    python3 scripts/make_placeholder_model.py                  # writes models/default/
    python3 scripts/make_placeholder_model.py --out /tmp/m     # elsewhere

Requirements: scripts/requirements.txt. Takes a few seconds on a CPU. Deterministic for a given Python standard
library (the tokenizer training corpus) and library versions.

What it writes
--------------
  tokenizer.json          byte-level BPE trained with `tokenizers` on Python standard-library sources (first ~4 MB of
                          *.py files under sysconfig stdlib, sorted by path, tests and codec tables excluded), configured like Qwen3.5:
                          NFC normaliser, Split(QWEN35 regex, isolated) + ByteLevel(add_prefix_space=False,
                          trim_offsets=False, use_regex=False) pre-tokenizer, ByteLevel decoder. 1997 BPE tokens
                          (256 byte tokens + merges) then the special tokens <|endoftext|>, <|im_start|>, <|im_end|>
                          (ids 1997, 1998, 1999) = 2000 tokens.
  tokenizer_config.json   Qwen-style, ChatML chat_template (system/user/assistant, add_generation_prompt).
  config.json             official multimodal wrapper layout (Qwen3_5ForConditionalGeneration, text_config,
                          vision_config), vocab 2048 (= 2000 rounded up to a multiple of 64: 48 embedding rows no token
                          maps to, as in the real models; drawn N(0, 0.02^2) so they are rarely predicted), hidden
                          128, 4 layers (3 GDN + 1 full attention), tied.
  model.safetensors       bf16, keys model.language_model.*, 2 fake model.visual.* tensors, 15 random mtp.* tensors.
  generation_config.json  do_sample, temperature 0.7, top_k 20, top_p 0.95, eos [<|im_end|>, <|endoftext|>],
                          bos/pad <|endoftext|>.
  README.md               says that the weights are random.

The weights are random (same rules as scripts/make_reference_fixtures.py): the model's output is meaningless text.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_reference_fixtures as mrf  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QWEN35_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_SIZE = 2000
CORPUS_BYTES = 4_000_000
SEED = 4242

# ChatML as rendered by the Qwen3 template for plain system/user/assistant messages (no tools, no thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CASE = dict(
    seed=SEED,
    dtype="bf16",
    layout="wrapper",
    shards=1,
    tied=True,
    mtp=True,
    out_gain=3.0,
    text={
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 32768,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "output_gate_type": "swish",
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [3, 3, 2],
        },
        "tie_word_embeddings": True,
        "use_cache": True,
        "dtype": "bfloat16",
        "bos_token_id": None,  # filled in from the tokenizer
        "eos_token_id": None,
    },
)


def corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    out, total = [], 0
    for p in files:
        if total >= CORPUS_BYTES:
            break
        out.append(p)
        total += p.stat().st_size
    return out


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                        byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    files = corpus_files()
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    print(f"tokenizer corpus: {len(files)} files, {sum(len(t.encode()) for t in texts)} bytes "
          f"({files[0].name} .. {files[-1].name})")
    trainer = BpeTrainer(vocab_size=TOKENIZER_SIZE - len(SPECIALS), min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_SIZE - len(SPECIALS), tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False, single_word=False, lstrip=False,
                                       rstrip=False) for s in SPECIALS])
    assert tok.get_vocab_size() == TOKENIZER_SIZE
    return tok


def tokenizer_config(tok) -> dict:
    added = {}
    for s in SPECIALS:
        added[str(tok.token_to_id(s))] = {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


README = """# models/default — random-weight placeholder

**This is not a trained model.** Every weight is drawn from a seeded random distribution, so the text it
generates is meaningless. It exists so that `mtpx` has a small default model to load, tokenize, chat-template and
decode with (including the native MTP head) until a trained checkpoint is shipped here.

How it was made: `python3 scripts/make_placeholder_model.py` (deterministic; see that script's docstring).

- Tokenizer: byte-level BPE trained with the `tokenizers` library on Python standard-library sources, configured
  like Qwen3.5 (NFC, Qwen3.5 split regex + ByteLevel pre-tokenizer, ByteLevel decoder). {ntok} tokens: {nbpe} BPE
  tokens (256 byte tokens + merges), then `<|endoftext|>`={eot}, `<|im_start|>`={ims}, `<|im_end|>`={ime}.
- Chat template: ChatML (`<|im_start|>role\\n...<|im_end|>\\n`, `add_generation_prompt` appends
  `<|im_start|>assistant\\n`).
- Model: Qwen3.5 architecture in the official multimodal wrapper layout (`Qwen3_5ForConditionalGeneration`,
  `text_config`, keys `model.language_model.*`, two dummy `model.visual.*` tensors that text engines ignore), bf16:
  - vocab {V} (tokenizer size rounded up to a multiple of 64; rows >= {ntok} belong to no token and are near zero)
  - hidden {H}, MLP {I}, tied embeddings
  - {L} layers: {layer_types}
  - full attention: {nq} query / {nkv} KV heads of dim {D}, rotary dim {rot}
  - Gated DeltaNet: {hk} key / {hv} value heads of dim {dk} / {dv}
  - one random MTP layer (`mtp.*`)
- generation_config.json: sampling with temperature 0.7, top_k 20, top_p 0.95; EOS = `<|im_end|>`, `<|endoftext|>`.
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "models" / "default"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_float32_matmul_precision("highest")

    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    eot, ims, ime = (tok.token_to_id(s) for s in SPECIALS)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tok), indent=2) + "\n")

    case = json.loads(json.dumps(CASE))
    V = case["text"]["vocab_size"]
    assert V == (TOKENIZER_SIZE + 63) // 64 * 64
    case["text"]["bos_token_id"] = eot
    case["text"]["eos_token_id"] = eot

    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    dtype = mrf.DTYPES[case["dtype"]]
    cfg = mrf.text_config_for_hf(case)
    model = Qwen3_5ForCausalLM(cfg)
    mrf.randomize_model(model, SEED, dtype, cfg.hidden_size, case["out_gain"])
    with torch.no_grad():  # rows no token maps to: small, as in trained models (rarely predicted, never sampled)
        emb = model.model.embed_tokens.weight
        pad = torch.randn(emb.shape[0] - TOKENIZER_SIZE, emb.shape[1], generator=torch.Generator().manual_seed(SEED))
        emb[TOKENIZER_SIZE:] = mrf.round_to(pad * 0.02, dtype)
    model = model.float().eval()
    tensors, shard_of = mrf.checkpoint_tensors(model, case, dtype)
    mrf.write_checkpoint(out, case, tensors, shard_of)
    gen = {"bos_token_id": eot, "do_sample": True, "eos_token_id": [ime, eot], "pad_token_id": eot,
           "temperature": 0.7, "top_k": 20, "top_p": 0.95, "transformers_version": "5.17.0"}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tc = case["text"]
    (out / "README.md").write_text(README.format(
        ntok=TOKENIZER_SIZE, nbpe=TOKENIZER_SIZE - 3, eot=eot, ims=ims, ime=ime, V=V, H=tc["hidden_size"],
        L=tc["num_hidden_layers"], layer_types=", ".join(tc["layer_types"]), nq=tc["num_attention_heads"],
        nkv=tc["num_key_value_heads"], D=tc["head_dim"], rot=int(tc["head_dim"] * tc["partial_rotary_factor"]),
        hk=tc["linear_num_key_heads"], hv=tc["linear_num_value_heads"], dk=tc["linear_key_head_dim"],
        dv=tc["linear_value_head_dim"], I=tc["intermediate_size"]))

    check(out, tok, ime)
    total = 0
    for f in sorted(out.iterdir()):
        total += f.stat().st_size
        print(f"  {f.name:28s} {f.stat().st_size:9d} B")
    print(f"models/default total: {total} B ({total / 2**20:.2f} MiB); params: "
          f"{sum(t.numel() for t in tensors.values())}")


def check(out: Path, tok, ime: int):
    """Reload through transformers: tokenizer equivalence, chat template, and a short greedy generation."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    transformers.logging.set_verbosity_error()
    hf_tok = AutoTokenizer.from_pretrained(out)
    samples = ["def hello(name):\n    return f'Hello, {name}!'\n", "Grüße, naïve café — 東京 2024!\r\n\tx  y   ",
               "<|im_start|>user\nhi<|im_end|>\n", "It's   we'll   DON'T\n\n\n"]
    for s in samples:
        a = tok.encode(s).ids
        b = hf_tok(s)["input_ids"]
        assert a == b, (s, a, b)
        assert tok.decode(a, skip_special_tokens=False) == s, (s, tok.decode(a))
    chat = hf_tok.apply_chat_template([{"role": "system", "content": "You are helpful."},
                                       {"role": "user", "content": "Hello!"}], tokenize=False,
                                      add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
                    "<|im_start|>assistant\n"), chat
    ids = torch.tensor([tok.encode(chat).ids])
    m = Qwen3_5ForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        g = m.generate(input_ids=ids, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    new = g[0, ids.shape[1]:].tolist()
    print(f"tokenizer OK ({tok.get_vocab_size()} tokens); chat prompt = {ids.shape[1]} tokens; "
          f"greedy continuation (random weights): {new} -> {tok.decode(new)!r}")


if __name__ == "__main__":
    main()
