#!/usr/bin/env python3
"""Writes a corpus of hostile model directories: each one a valid tiny checkpoint (from `mtpx synth`)
with one thing broken on purpose: safetensors headers that lie (offsets past the end, overlapping
tensors, sizes that overflow, a dtype that does not fit the shape, duplicate keys, absurd header
lengths, deep nesting), NaN/Inf weights, files that are not files (FIFOs, /dev/zero, directories),
symlinks and index entries that lead outside the directory, indexes naming missing shards, and configs
with absurd sizes (2^40 layers, negative heads, hidden_size 0, ...).

    python3 scripts/make_hostile_models.py --mtpx build/mtpx --out /tmp/hostile

Standard library only. Writes DIR/<case>/ for every case and DIR/cases.json: for each case its
description and the expected outcome of `mtpx generate` and `mtpx inspect` (`error` with a needle that
the one-line message must contain, or `ok`). tests/hostile/test_hostile_models.py runs them.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys

BASE = "_base"  # the valid checkpoint every case starts from


def read_safetensors(path):
    """(header dict, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path, header_text, data=b"", header_len=None):
    """A safetensors file from header text as given (not re-encoded), optionally with a false length."""
    encoded = header_text.encode() if isinstance(header_text, str) else header_text
    length = len(encoded) if header_len is None else header_len
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length))
        f.write(encoded)
        f.write(data)


def write_safetensors(path, header, data):
    write_raw(path, json.dumps(header, separators=(",", ":")), data)


class Corpus:
    def __init__(self, out, mtpx):
        self.out = os.path.abspath(out)
        self.cases = []
        base = os.path.join(self.out, BASE)
        if os.path.exists(self.out):
            shutil.rmtree(self.out)
        os.makedirs(self.out)
        subprocess.run([mtpx, "synth", "--shape", "tiny", "--out", base, "--seed", "5"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = base
        self.header, self.data = read_safetensors(os.path.join(base, "model.safetensors"))
        with open(os.path.join(base, "config.json")) as f:
            self.config = json.load(f)

    def case(self, name, what, generate, inspect=None, check_values=False, max_rss_mib=100):
        """A new case directory holding hard links to the base files (replace what the case breaks).
        `generate` / `inspect`: ("error", needle) or ("ok", needle in stdout or None); inspect defaults to
        generate's. `check_values`: run inspect with --check-values (reads every weight). `max_rss_mib`: the
        peak resident memory a run may reach (a valid run of the base checkpoint needs ~25 MiB)."""
        path = os.path.join(self.out, name)
        os.makedirs(path)
        for entry in os.listdir(self.base):
            os.link(os.path.join(self.base, entry), os.path.join(path, entry))
        self.cases.append({"name": name, "what": what, "generate": list(generate),
                           "inspect": list(inspect or generate), "check_values": check_values,
                           "max_rss_mib": max_rss_mib})
        return path

    def replace(self, directory, name):
        """Unlinks a hard-linked base file so the case can write its own."""
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            os.unlink(path)
        return path

    def with_header(self, name, what, needle, mutate, data=None):
        """A case whose model.safetensors has the base header after `mutate(header)`."""
        d = self.case(name, what, ("error", needle))
        header = json.loads(json.dumps(self.header))
        mutate(header)
        write_safetensors(self.replace(d, "model.safetensors"), header, self.data if data is None else data)

    def with_config(self, name, what, needle, mutate):
        d = self.case(name, what, ("error", needle))
        config = json.loads(json.dumps(self.config))
        mutate(config["text_config"] if "text_config" in config else config)
        with open(self.replace(d, "config.json"), "w") as f:
            json.dump(config, f)

    def save(self):
        with open(os.path.join(self.out, "cases.json"), "w") as f:
            json.dump(self.cases, f, indent=1)


def tensor_names(header):
    return sorted(k for k in header if k != "__metadata__")


def build(out, mtpx):
    c = Corpus(out, mtpx)
    names = tensor_names(c.header)
    embed = next(n for n in names if n.endswith("embed_tokens.weight"))
    norm = next(n for n in names if n.endswith("layers.0.input_layernorm.weight"))
    matrix = next(n for n in names if n.endswith("layers.0.mlp.up_proj.weight"))
    data_size = len(c.data)

    # --- safetensors headers that lie -------------------------------------------------------------
    def past_end(h):
        h[matrix]["data_offsets"][1] += data_size
        h[matrix]["data_offsets"][0] += data_size
    c.with_header("offsets_past_end", "a tensor's data_offsets point beyond the end of the file",
                  "beyond the", past_end)
    c.with_header("truncated_file", "the file is cut short: the last tensors' bytes are missing",
                  "beyond the", lambda h: None, data=c.data[:data_size // 2])

    def overlap(h):
        other = next(n for n in names if n != matrix and h[n]["shape"] == h[matrix]["shape"]
                     and h[n]["dtype"] == h[matrix]["dtype"])
        h[other]["data_offsets"] = list(h[matrix]["data_offsets"])
    c.with_header("overlapping_tensors", "two tensors share the same bytes", "overlap", overlap)

    def huge_shape(h):
        h[matrix]["shape"] = [1 << 40, 1 << 40]
    c.with_header("huge_shape_overflow", "a shape whose byte size overflows 64 bits", "overflows", huge_shape)

    def huge_declared(h):
        h[matrix]["shape"] = [1 << 31, 1 << 20]
        h[matrix]["data_offsets"] = [0, (1 << 51) * 2]
    c.with_header("huge_declared_size", "a 2^51-element tensor with matching offsets (8 PiB declared)",
                  "beyond the", huge_declared)

    def wrong_dtype(h):
        h[matrix]["dtype"] = "F32"  # the bytes are sized for BF16
    c.with_header("wrong_dtype_for_shape", "F32 declared for BF16-sized data", "size mismatch", wrong_dtype)

    def unknown_dtype(h):
        h[matrix]["dtype"] = "F8_E4M3"
    c.with_header("unknown_dtype", "a dtype mtpx does not know", "unknown dtype", unknown_dtype)

    def negative_dim(h):
        h[matrix]["shape"] = [-1, h[matrix]["shape"][1]]
    c.with_header("negative_dimension", "a negative dimension", "non-negative", negative_dim)

    def float_offsets(h):
        h[matrix]["data_offsets"] = [0.5, 7.25]
    c.with_header("float_offsets", "data_offsets that are not integers", "data_offsets", float_offsets)

    def int_weights(h):
        # Same bytes, but declared as I16 (valid safetensors, not a weight dtype).
        h[matrix]["dtype"] = "I16"
    c.with_header("integer_weights", "a weight matrix stored as I16", "dtype I16", int_weights)

    def wrong_shape(h):
        rows, cols = h[matrix]["shape"]
        h[matrix]["shape"] = [cols, rows]
    c.with_header("transposed_shape", "a matrix with rows and columns swapped", "wrong shape", wrong_shape)

    # Duplicate keys cannot be written with json.dumps: splice a second entry into the text.
    d = c.case("duplicate_tensor_key", "the same tensor name twice in the header (JSON duplicate key)",
               ("error", "duplicate key"))
    text = json.dumps(c.header, separators=(",", ":"))
    entry = json.dumps({matrix: c.header[matrix]}, separators=(",", ":"))[1:-1]
    write_raw(c.replace(d, "model.safetensors"), "{" + entry + "," + text[1:], c.data)

    for name, length, needle in [("header_len_absurd", 1 << 62, "exceeds the limit"),
                                 ("header_len_max", (1 << 64) - 1, "exceeds the limit"),
                                 ("header_len_past_file", 50 << 20, "exceeds the"),
                                 ("header_len_zero", 0, "not valid JSON")]:
        d = c.case(name, f"header length field = {length}", ("error", needle))
        write_raw(c.replace(d, "model.safetensors"), json.dumps(c.header), c.data, header_len=length)

    d = c.case("header_not_json", "header bytes that are not JSON", ("error", "not valid JSON"))
    write_raw(c.replace(d, "model.safetensors"), b"\xff\xfe{not json" + b" " * 100, c.data)
    d = c.case("header_deep_nesting", "a header of 1,000,000 nested arrays (stack exhaustion)",
               ("error", "nested deeper"))
    write_raw(c.replace(d, "model.safetensors"), "[" * 1_000_000 + "]" * 1_000_000, c.data)
    d = c.case("header_deep_shape", "a shape of 100,000 nested arrays", ("error", "nested deeper"))
    deep = "[" * 100_000 + "1" + "]" * 100_000
    text = json.dumps(c.header, separators=(",", ":"))
    shape = json.dumps(c.header[matrix]["shape"], separators=(",", ":"))
    write_raw(c.replace(d, "model.safetensors"), text.replace(shape, deep, 1), c.data)
    # Headers of many empty tensors: just under mtpx's 16 MiB limit (parsed: the memory it costs is
    # bounded by that limit), and 60 MiB (under the reference implementation's 100 MB; refused unread).
    entries = ",".join(f'"t{i}":{{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}' for i in range(800_000))
    for mib, needle in [(15.9, "missing tensor"), (60, "exceeds the limit")]:
        d = c.case(f"header_{mib:.0f}mib", f"a {mib} MiB header declaring {int(mib * 2**20) // 75:,} empty tensors",
                   ("error", needle), max_rss_mib=320)
        text = entries[:int(mib * 2**20) - 2]
        text = text[:text.rindex("},") + 1]
        write_raw(c.replace(d, "model.safetensors"), "{" + text + "}")
    d = c.case("empty_file", "a 0-byte model.safetensors", ("error", "shorter than"))
    open(c.replace(d, "model.safetensors"), "wb").close()

    # --- NaN / Inf weights: well-formed files, bad values ------------------------------------------
    def poison(name, what, tensor, value, where):
        """Overwrites element `where` of a bf16 tensor with `value` (bf16 bits)."""
        d = c.case(name, what, ("error", tensor), ("ok", tensor), check_values=True)
        data = bytearray(c.data)
        begin = c.header[tensor]["data_offsets"][0]
        assert c.header[tensor]["dtype"] == "BF16"
        for i in where:
            struct.pack_into("<H", data, begin + 2 * i, value)
        write_safetensors(c.replace(d, "model.safetensors"), c.header, bytes(data))
    poison("nan_norm", "NaN in every element of a layer norm", norm, 0x7FC0, range(c.header[norm]["shape"][0]))
    poison("inf_matrix", "+Inf in the first row of an MLP matrix", matrix, 0x7F80,
           range(c.header[matrix]["shape"][1]))
    poison("nan_embedding", "NaN in every embedding row of the prompt's tokens (tied lm_head)", embed, 0x7FC0,
           range(c.header[embed]["shape"][1] * 8))

    # --- files that are not regular files ---------------------------------------------------------
    d = c.case("weights_fifo", "model.safetensors is a FIFO (opening it would block)", ("error", "regular file"))
    os.mkfifo(c.replace(d, "model.safetensors"))
    d = c.case("weights_dev_zero", "model.safetensors -> /dev/zero", ("error", "outside the model directory"))
    os.symlink("/dev/zero", c.replace(d, "model.safetensors"))
    d = c.case("weights_directory", "model.safetensors is a directory", ("error", "model.safetensors"))
    os.mkdir(c.replace(d, "model.safetensors"))
    d = c.case("config_fifo", "config.json is a FIFO", ("error", "regular file"))
    os.mkfifo(c.replace(d, "config.json"))
    d = c.case("config_dev_zero", "config.json -> /dev/zero (endless)", ("error", "regular file"))
    os.symlink("/dev/zero", c.replace(d, "config.json"))
    d = c.case("config_huge", "a 200 MiB config.json (sparse)", ("error", "larger than"))
    with open(c.replace(d, "config.json"), "wb") as f:
        f.truncate(200 << 20)
    d = c.case("tokenizer_dev_zero", "tokenizer.json -> /dev/zero", ("error", "regular file"),
               ("ok", "not a regular file"))
    os.symlink("/dev/zero", os.path.join(d, "tokenizer.json"))
    d = c.case("generation_config_fifo", "generation_config.json is a FIFO", ("error", "regular file"),
               ("ok", "not a regular file"))
    os.mkfifo(c.replace(d, "generation_config.json"))

    # --- symlinks and index entries that leave the directory ---------------------------------------
    outside = os.path.join(c.out, "_outside")
    os.makedirs(outside, exist_ok=True)
    shutil.copy(os.path.join(c.base, "model.safetensors"), os.path.join(outside, "model.safetensors"))
    d = c.case("symlink_outside", "model.safetensors is a symlink to a file outside the directory",
               ("error", "outside the model directory"))
    os.symlink(os.path.join(outside, "model.safetensors"), c.replace(d, "model.safetensors"))
    d = c.case("symlink_relative_outside", "model.safetensors -> ../_outside/model.safetensors",
               ("error", "outside the model directory"))
    os.symlink("../_outside/model.safetensors", c.replace(d, "model.safetensors"))

    def with_index(name, what, needle, weight_map, shards=()):
        d = c.case(name, what, ("error", needle))
        os.unlink(os.path.join(d, "model.safetensors"))
        for shard in shards:
            os.link(os.path.join(c.base, "model.safetensors"), os.path.join(d, shard))
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            if isinstance(weight_map, str):
                f.write(weight_map)
            else:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)
        return d
    all_in = {n: "model-00001-of-00002.safetensors" for n in names}
    with_index("index_missing_shard", "the index names a shard that does not exist", "does not exist",
               {**all_in, matrix: "model-00002-of-00002.safetensors"}, ["model-00001-of-00002.safetensors"])
    with_index("index_dotdot", "an index entry '../_outside/model.safetensors'", "not a plain file name",
               {**all_in, matrix: "../_outside/model.safetensors"}, ["model-00001-of-00002.safetensors"])
    with_index("index_absolute", "an index entry with an absolute path", "not a plain file name",
               {**all_in, matrix: os.path.join(outside, "model.safetensors")},
               ["model-00001-of-00002.safetensors"])
    d = with_index("index_symlink_outside", "an index shard that is a symlink leaving the directory",
                   "outside the model directory", all_in)
    os.symlink(os.path.join(outside, "model.safetensors"), os.path.join(d, "model-00001-of-00002.safetensors"))
    with_index("index_wrong_shard", "the index puts a tensor in a shard that lacks it", "missing from shard",
               {**all_in, "model.language_model.made_up.weight": "model-00001-of-00002.safetensors"},
               ["model-00001-of-00002.safetensors"])
    pairs = ",".join(f'"{n}":"model-00001-of-00002.safetensors"' for n in names)
    with_index("index_duplicate_key", "the index names one tensor twice", "duplicate key",
               '{"weight_map":{"' + matrix + '":"x.safetensors",' + pairs + "}}",
               ["model-00001-of-00002.safetensors"])
    with_index("index_not_object", "weight_map is a list", "weight_map", '{"weight_map": []}')

    # --- configs with absurd sizes (must be refused before anything is allocated) ------------------
    def setter(**values):
        return lambda t: t.update(values)
    c.with_config("config_layers_2p40", "num_hidden_layers = 2^40", "num_hidden_layers",
                  setter(num_hidden_layers=1 << 40))
    c.with_config("config_negative_heads", "num_attention_heads = -4", "num_attention_heads",
                  setter(num_attention_heads=-4))
    c.with_config("config_hidden_zero", "hidden_size = 0", "hidden_size", setter(hidden_size=0))
    c.with_config("config_vocab_2p40", "vocab_size = 2^40", "vocab_size", setter(vocab_size=1 << 40))
    c.with_config("config_vocab_2p64", "vocab_size = 2^64 (beyond int64)", "vocab_size",
                  setter(vocab_size=1 << 64))
    c.with_config("config_head_dim_float", "head_dim = 64.5", "head_dim", setter(head_dim=64.5))
    c.with_config("config_heads_not_dividing", "num_attention_heads not a multiple of num_key_value_heads",
                  "multiple", setter(num_attention_heads=5, num_key_value_heads=2))
    c.with_config("config_linear_heads_not_dividing", "linear value heads not a multiple of key heads",
                  "multiple", setter(linear_num_value_heads=3, linear_num_key_heads=2))
    c.with_config("config_rotary_odd", "head_dim x partial_rotary_factor odd", "even",
                  lambda t: (t.update(head_dim=66), t["rope_parameters"].update(partial_rotary_factor=0.5)))
    c.with_config("config_layer_types_mismatch", "layer_types shorter than num_hidden_layers", "layer_types",
                  setter(layer_types=["linear_attention", "full_attention"]))
    c.with_config("config_layer_types_unknown", "an unknown layer type", "layer type",
                  setter(layer_types=["linear_attention", "linear_attention", "linear_attention", "moe"]))
    def at_upper_bounds(t):
        del t["layer_types"]  # full attention every 4th layer, for any layer count
        t.update(hidden_size=65536, intermediate_size=262144, vocab_size=1 << 22, num_hidden_layers=1024,
                 num_attention_heads=1024, num_key_value_heads=1024, head_dim=1024)
    c.with_config("config_big_but_in_range", "every size at its upper bound (the tensors stay tiny)",
                  "wrong shape", at_upper_bounds)
    c.with_config("config_context_2p40", "max_position_embeddings = 2^41", "max_position_embeddings",
                  setter(max_position_embeddings=1 << 41))
    c.with_config("config_eos_out_of_range", "eos_token_id = -1", "eos_token_id", setter(eos_token_id=-1))
    c.with_config("config_string_sizes", "hidden_size = \"256\"", "hidden_size", setter(hidden_size="256"))
    d = c.case("config_duplicate_key", "config.json with tie_word_embeddings twice", ("error", "duplicate key"))
    text = json.dumps(c.config)
    with open(c.replace(d, "config.json"), "w") as f:
        f.write('{"tie_word_embeddings": false, ' + text[1:])
    d = c.case("config_deep_nesting", "config.json of 1,000,000 nested arrays", ("error", "nested deeper"))
    with open(c.replace(d, "config.json"), "w") as f:
        f.write("[" * 1_000_000 + "]" * 1_000_000)
    d = c.case("config_not_json", "config.json is not JSON", ("error", "not valid JSON"))
    with open(c.replace(d, "config.json"), "wb") as f:
        f.write(b"\x00\x01garbage")
    d = c.case("config_missing", "no config.json", ("error", "config.json"))
    os.unlink(os.path.join(d, "config.json"))
    c.save()
    return c.cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtpx", required=True, help="the mtpx binary (writes the base checkpoint)")
    parser.add_argument("--out", required=True, help="corpus directory (replaced)")
    args = parser.parse_args()
    cases = build(args.out, args.mtpx)
    print(f"wrote {len(cases)} hostile model directories to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
