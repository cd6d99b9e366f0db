#!/usr/bin/env python3
"""Builds the tokenizer parity fixtures under tests/data/tokenizers/.

Trains a few small byte-level BPE tokenizers with the Hugging Face `tokenizers` library, configured like
the Qwen family (NFC, regex Split + ByteLevel pre-tokenizer, ByteLevel decoder, chat special tokens), and
records the ids and decoded text the real library produces for every text of a multilingual corpus.
tests/tokenizer_test.cpp checks mtpx::Tokenizer against these goldens.

Usage: python3 scripts/make_tokenizer_goldens.py   (deterministic; rerun after changing anything here)

Outputs (all committed):
  tests/data/tokenizers/<name>.json  tokenizer files
  tests/data/tokenizers/corpus.json  the test texts (a JSON list of strings)
  tests/data/tokenizers/goldens.json per tokenizer: ids and decoded text per text
"""

import glob
import json
import os
import random
import sys
import unicodedata

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "tokenizers")

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                  r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Multilingual training text (the training corpus is mostly Python source, so these make sure the
# tokenizers learn some non-ASCII merges).
MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog. I'll tell you what they've done, don't worry.",
    "人工智能正在改变世界。我们今天学习如何使用大型语言模型进行推理，这是一个非常有趣的问题。",
    "日本語の文章を書いています。東京は日本の首都です。ひらがなとカタカナと漢字を使います。",
    "한국어 문장입니다. 서울은 대한민국의 수도입니다. 안녕하세요, 만나서 반갑습니다.",
    "مرحبا بالعالم. اللغة العربية جميلة جدا، وهي لغة رسمية في كثير من الدول.",
    "नमस्ते दुनिया। हिंदी भारत की एक प्रमुख भाषा है और देवनागरी लिपि में लिखी जाती है।",
    "Привет, мир! Русский язык является одним из самых распространённых языков в мире.",
    "Ελληνικά: Γειά σου Κόσμε. Français : élève, café, naïve, garçon, Noël, déjà vu.",
    "Deutsch: Größe, Straße, Übermäßig, schön. Español: ¿Dónde está la biblioteca? ¡Mañana!",
    "Emoji: 😀😃😄 👍🏽 👩‍💻 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🔥🔥🔥",
    "Tiếng Việt: Xin chào thế giới, tôi đang học lập trình. ภาษาไทย: สวัสดีชาวโลก",
]


def training_corpus():
    texts = []
    total = 0
    for path in sorted(glob.glob("/usr/lib/python3.11/*.py")) or sorted(
            glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        texts.append(text)
        total += len(text)
        if total > 2_000_000:
            break
    for _ in range(40):
        texts.extend(MULTILINGUAL)
    return texts


def random_texts():
    """Seeded random strings over code points that stress the regex, NFC and byte-level paths."""
    rng = random.Random(1234)
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        " \t\n\r\x0b\x0c\x85\xa0\u1680\u180e\u2000\u2009\u200a\u200b\u2028\u2029\u202f\u205f\u3000\ufeff",
        "".join(chr(c) for c in range(0x300, 0x370)),  # combining marks
        "éèêëçñöüßſ\u212a\u2126ǅ",
        "的一是不了人我在有他这为之大来以个中上们",
        "あいうえおかきくけこアイウエオガギグ\u3099\u309a",
        "".join(chr(c) for c in range(0x1100, 0x1113)) + "".join(chr(c) for c in range(0x1161, 0x1176)),
        "가각간갇갈감갑값",
        "مرحبابالعالم\u064b\u064c\u0651",
        "नमस्तेदुनिया\u094d\u093c",
        "😀👍🏽👩\u200d💻🇯🇵❤\ufe0f\U0001F3FB\U0001F9D1",
        "\U0001D400\U0001D401\U0001D7CE\U00020000\U0010FFFD\ue000",
        "²³¹¼½Ⅷ٣߂৩",
        "'sStTlLdDmMvVrReE",
        "\x00\x01\x1c\x1d\x1e\x1f\x7f\x80\x9f",
    ]
    out = []
    for n in (8, 16, 32, 64, 128, 256, 512, 1024):
        for _ in range(2):
            chars = []
            while len(chars) < n:
                pool = rng.choice(pools)
                run = rng.randint(1, 6)
                chars.extend(rng.choice(pool) for _ in range(run))
            out.append("".join(chars[:n]))
    return out


def test_texts():
    texts = [
        "",
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "I'LL don't you'Re WE'VE it's He'D i'M",
        "'s 't 're 've 'm 'll 'd 'ſ 'S'T",
        "12345 3.14159 -42 1,000,000 ٣٤٥ ²³",
        "   ",
        "\n\n\n",
        " \t\n  ",
        "a   b\t\tc\n\nd \n e",
        "trailing spaces   ",
        "   leading spaces",
        "\r\n\r\nwindows\r\nline endings\r\n",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
        "class Foo:\n\tdef bar(self):\n\t\treturn {'a': [1, 2, 3]}  # comment\n",
        "#include <vector>\n\nint main() {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) x *= 2;\n"
        "  return v.size() == 3 ? 0 : 1;\n}\n",
        "if (a && b || !c) { x->y = z[i++]; } // C++ ptr->member; /* block */",
        "人工智能正在改变世界。",
        "我喜欢吃苹果，你呢？",
        "日本語のテキストです。カタカナとひらがな。",
        "한국어 텍스트입니다. 안녕하세요!",
        "مرحبا بالعالم، كيف حالك؟",
        "नमस्ते दुनिया, आप कैसे हैं?",
        "Привет, мир! Как дела?",
        "Γειά σου Κόσμε",
        "Xin chào thế giới",
        "สวัสดีชาวโลก",
        "😀😃😄😁",
        "👍🏽👍🏿👋🏻",
        "👩‍💻👨‍👩‍👧‍👦🏳️‍🌈",
        "🇯🇵🇺🇸🇩🇪",
        "❤️🔥✨🎉",
        "cafe\u0301 vs caf\u00e9",  # decomposed vs precomposed
        "e\u0301e\u0301e\u0301",
        "A\u030a\u0301 \u212b \u1e9b\u0323",  # NFC reorders / composes
        "\u1100\u1161\u11a8 \u1112\u1161\u11ab",  # conjoining jamo -> Hangul syllables under NFC
        "\u304b\u3099\u304d\u3099 が ぎ",  # kana + combining dakuten
        "\uac54\u11a7 \u1100\u1161\u11a7 \uac00\u11a8",  # U+11A7 is no trailing consonant: no composition
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
        "<|endoftext|>",
        "<|endoftext|><|endoftext|>",
        "text<|im_end|>more text<|im_start|>",
        "<|im_start|<|im_end|> <|im_start|>>",
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n",
        "Use [MASK] here and [MASK]there,[MASK] ok",
        "mtpx is great; xmtpx mtpx_ mtpx. (mtpx) mtpx中 mtpx\u0301 mtpx",
        "mtpx² ²mtpx mtpx\u200d mtpx٣ Ⅷmtpx mtpx\u00a0mtpx\u3000mtpx",
        "\u304c\u304d token: \u304b\u3099\u304d and \u304d\u3099 vs \u304e",
        "Non-breaking\u00a0space and ideographic\u3000space and nel\u0085here",
        "mongolian\u180evowel zero\u200bwidth bom\ufeffhere line\u2028sep para\u2029sep",
        "NUL\x00byte and \x1f unit sep \x7f del",
        "https://example.com/path?query=1&x=y#frag user@example.org",
        "$$$ !!! ??? ... --- === *** ### @@@",
        "    indented\n        more indented\n\n\n\tthen tab\n",
        "mixed English 中文 日本語 한국어 العربية हिन्दी русский 123 😀",
        "\U0001D400\U0001D401 math bold, \U00020000 CJK ext B, \ue000 private use, \ufffd replacement",
        "ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖ×ØÙÚÛÜÝÞßàáâãäåæçèéêëìíîïðñòóôõö÷øùúûüýþÿ",
        "ĀāĂăĄąĆćĈĉĊċČčĎďĐđĒēĔĕĖėĘęĚěĜĝĞğĠġĢģĤĥĦħĨĩĪīĬĭĮįİıĲĳĴĵĶķĸĹĺĻļĽľĿŀŁłŃ",
        "a\nb\n\nc\n\n\nd \n\n e\t\n\t f",
        "x" * 300,
        "1" * 50 + " " + "9" * 50,
    ]
    long_line = " ".join(MULTILINGUAL) * 20 + " def f(x):\t return x ** 2  # done"
    texts.append(long_line)
    texts.extend(random_texts())
    return texts


def configure(tok, pattern, add_prefix_space=False):
    tok.normalizer = normalizers.NFC()
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)


def train(corpus, vocab_size, pattern, specials_in_vocab, add_prefix_space=False):
    tok = Tokenizer(models.BPE())
    configure(tok, pattern, add_prefix_space)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=CHAT_SPECIALS if specials_in_vocab else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    if not specials_in_vocab:
        # Like Qwen: the special tokens are added tokens after the model vocabulary.
        tok.add_special_tokens(CHAT_SPECIALS)
    return tok


def main():
    print(f"tokenizers {tokenizers.__version__}", file=sys.stderr)
    os.makedirs(OUT_DIR, exist_ok=True)
    corpus = training_corpus()

    specs = []

    # Qwen3.5-like, 4000 pieces, merges as ["a", "b"] pairs, plus added tokens with various flags.
    tok = train(corpus, 4000, QWEN35_PATTERN, specials_in_vocab=False)
    tok.add_tokens([
        AddedToken("mtpx", single_word=True, normalized=False, special=False),
        AddedToken("\u304b\u3099\u304d", normalized=True, special=False),  # matched after NFC
        AddedToken("\u304d\u3099", normalized=False, special=False),  # matched on the raw text only
    ])
    tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, rstrip=True, normalized=False, special=True)])
    specs.append(("qwen35_4k", tok, None))

    # Qwen2/Qwen3-like, 2000 pieces, merges rewritten in the legacy "a b" string format.
    tok = train(corpus, 2000, QWEN2_PATTERN, specials_in_vocab=False)
    specs.append(("qwen2_2k", tok, "legacy_merges"))

    # GPT-2-like: plain ByteLevel(use_regex=True), no normalizer, special tokens inside the vocab.
    tok = train(corpus, 500, None, specials_in_vocab=True)
    tok.normalizer = None
    specs.append(("gpt2_500", tok, None))

    # Qwen3.5 pattern followed by ByteLevel(add_prefix_space=True) (each regex piece gets a space).
    tok = train(corpus, 1000, QWEN35_PATTERN, specials_in_vocab=False, add_prefix_space=True)
    specs.append(("qwen35_prefix_1k", tok, None))

    texts = test_texts()
    with open(os.path.join(OUT_DIR, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=False, indent=0)
        f.write("\n")

    goldens = {"tokenizers_version": tokenizers.__version__, "tokenizers": []}
    for name, tok, variant in specs:
        path = os.path.join(OUT_DIR, name + ".json")
        tok.save(path, pretty=False)
        if variant == "legacy_merges":
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            merges = data["model"]["merges"]
            assert all(" " not in a and " " not in b for a, b in merges)
            data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False)
        # Reload from disk so the goldens come from exactly the committed file.
        tok = Tokenizer.from_file(path)
        entries = []
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            entries.append({
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=False),
            })
        goldens["tokenizers"].append({
            "name": name,
            "file": name + ".json",
            "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "normalizer_nfc": tok.normalizer is not None,
            "results": entries,
        })
        print(f"{name}: vocab {tok.get_vocab_size(with_added_tokens=True)}, "
              f"{sum(len(e['ids']) for e in entries)} ids", file=sys.stderr)
    goldens["nfc"] = [unicodedata.normalize("NFC", t) for t in texts]
    with open(os.path.join(OUT_DIR, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(goldens, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
