#!/usr/bin/env python3
"""Writes the generated seed corpora of the fuzz targets: one directory per target under OUT, made from
the real files of the repository (safetensors headers, configs, tokenizers, chat templates, request bodies
built from the chat-template goldens). Hand-written small seeds and the inputs of past findings are
committed under fuzz/corpus/<target>/ instead; scripts/fuzz.sh passes both.

    python3 fuzz/make_seeds.py OUT
"""
import glob
import hashlib
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_SEED = 128 * 1024  # larger files make every execution slow


def write(out, target, data):
    if isinstance(data, str):
        data = data.encode()
    if len(data) > MAX_SEED:
        return
    folder = os.path.join(out, target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, hashlib.sha1(data).hexdigest()), "wb") as f:
        f.write(data)


def files(pattern):
    return sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True))


def safetensors_seeds(out):
    for path in files("models/**/*.safetensors") + files("tests/**/*.safetensors"):
        with open(path, "rb") as f:
            length_field = f.read(8)
            (n,) = struct.unpack("<Q", length_field)
            header = f.read(n)
            if os.path.getsize(path) <= MAX_SEED:
                f.seek(0)
                write(out, "fuzz_safetensors", f.read())  # a whole small file
            else:
                write(out, "fuzz_safetensors", length_field + header)  # header, data section cut off
        write(out, "fuzz_safetensors", header)  # the target frames a bare header itself
    for path in files("tests/**/model.safetensors.index.json"):
        with open(path, "rb") as f:
            write(out, "fuzz_safetensors_index", f.read())


def config_seeds(out):
    for path in files("models/**/*config.json") + files("tests/fixtures/**/*config.json"):
        with open(path, "rb") as f:
            write(out, "fuzz_model_config", f.read())


def tokenizer_seeds(out):
    for path in files("tests/data/tokenizers/*.json"):
        if os.path.basename(path) in ("corpus.json", "goldens.json"):
            continue
        with open(path, "rb") as f:
            write(out, "fuzz_tokenizer_load", f.read())
    with open(os.path.join(ROOT, "tests/data/tokenizers/corpus.json"), encoding="utf-8") as f:
        for text in json.load(f):
            write(out, "fuzz_tokenizer_encode", text)
    with open(os.path.join(ROOT, "tests/fixtures/trained_default/heldout_samples.json"), encoding="utf-8") as f:
        samples = json.load(f)["samples"]
    for sample in samples:  # Python source, what the shipped model is for
        write(out, "fuzz_tokenizer_encode", sample["prompt_text"] + sample["greedy_text"])
        write(out, "fuzz_tool_calls", "<tool_call>\n<function=run>\n<parameter=code>\n" + sample["prompt_text"] +
              "\n</parameter>\n</function>\n</tool_call>")


def chat_seeds(out):
    for path in files("tests/fixtures/chat_template/*.jinja"):
        with open(path, "rb") as f:
            write(out, "fuzz_chat_template", f.read())
    with open(os.path.join(ROOT, "models/default/tokenizer_config.json"), encoding="utf-8") as f:
        write(out, "fuzz_chat_template", json.load(f)["chat_template"])

    with open(os.path.join(ROOT, "tests/fixtures/chat_template/goldens.json"), encoding="utf-8") as f:
        goldens = json.load(f)
    for case in goldens["cases"]:
        body = {"model": "default", "messages": case["messages"], "max_tokens": 16}
        if case["tools"] is not None:
            body["tools"] = case["tools"]
        if case["kwargs"]:
            body["chat_template_kwargs"] = case["kwargs"]
        write(out, "fuzz_openai_request", json.dumps(body))
        write(out, "fuzz_openai_request",
              json.dumps(dict(body, stream=True, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=7,
                              stop=["\n\n", "###"], mtp=True, draft=3, stream_options={"include_usage": True})))
    for prompt in ("def fib(n):", [1, 2, 3], ["import os"], [[5, 6, 7]]):
        write(out, "fuzz_openai_request", json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    safetensors_seeds(out)
    config_seeds(out)
    tokenizer_seeds(out)
    chat_seeds(out)
    for target in sorted(os.listdir(out)):
        print(f"{target}: {len(os.listdir(os.path.join(out, target)))} seeds")


if __name__ == "__main__":
    main()
