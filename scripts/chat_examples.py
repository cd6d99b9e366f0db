#!/usr/bin/env python3
"""Chat-formatted training examples built from Python source files, for the shipped model
(scripts/train_small_model.py --chat-frac): a request written from a function's docstring, signature or
leading comment, and the function itself as the answer, in a fenced code block, in the chat template the
tokenizer config declares (ChatML, scripts/make_placeholder_model.py):

    <|im_start|>user
    Write a Python function `clamp(x, lo, hi)` that limits x to the range [lo, hi].<|im_end|>
    <|im_start|>assistant
    ```python
    def clamp(x, lo, hi):
        ...
    ```<|im_end|>

The requests come in several forms (an instruction from the docstring's first sentence, the bare
signature, the signature plus the docstring, a leading comment), chosen per function by a hash of its
file and name, so the data is deterministic. Only small functions (2..--max-lines lines) with a
docstring or a leading comment are used; the answer keeps the function's own text (dedented).

    python3 scripts/chat_examples.py FILE.py [...]     # prints the examples of these files
"""
from __future__ import annotations

import ast
import hashlib
import re
import sys
import textwrap

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def chat_text(request: str, answer: str) -> str:
    """One exchange in the ChatML template the shipped tokenizer_config.json declares."""
    return f"{IM_START}user\n{request}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = m.group(1) if m else text
    return sentence.strip()


def _signature(source: str) -> str | None:
    """The def line(s) up to the colon that opens the body, joined into one line."""
    m = re.match(r"\s*((?:async\s+)?def\s+\w+\s*\(.*?\)\s*(?:->\s*[^:]+)?):", source, re.S)
    return " ".join(m.group(1).split()) if m else None


def _hash(*parts: str) -> int:
    return int(hashlib.sha1("\0".join(parts).encode()).hexdigest()[:8], 16)


def _instruction(sentence: str) -> str:
    """'Return the sum of xs.' -> 'returns the sum of xs.' (a clause after 'that')."""
    words = sentence.split(" ", 1)
    verb = words[0]
    rest = words[1] if len(words) > 1 else ""
    lower = verb[:1].lower() + verb[1:]
    if lower.endswith(("s", "ed")) or not lower.isalpha():
        clause = lower
    elif lower.endswith(("sh", "ch", "x", "z")):
        clause = lower + "es"
    elif lower.endswith("y") and len(lower) > 1 and lower[-2] not in "aeiou":
        clause = lower[:-1] + "ies"
    else:
        clause = lower + "s"
    return (clause + (" " + rest if rest else "")).rstrip()


def examples_from_source(relpath: str, text: str, max_lines: int = 40) -> list[str]:
    """The chat examples of one source file (possibly none)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if node.name.startswith("__") or node.end_lineno is None:
            continue
        start = min([d.lineno for d in node.decorator_list] + [node.lineno])
        n_lines = node.end_lineno - start + 1
        if n_lines < 2 or n_lines > max_lines:
            continue
        source = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno])).rstrip()
        if not source or "\t" in source:
            continue
        signature = _signature(textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno])))
        if not signature:
            continue
        doc = ast.get_docstring(node) or ""
        comment = ""
        above = start - 2  # the line above the function (0-based)
        while above >= 0 and lines[above].strip().startswith("#"):
            comment = lines[above].strip().lstrip("#").strip() + (" " + comment if comment else "")
            above -= 1
        sentence = _first_sentence(doc) if doc else ""
        if len(sentence) < 12 and len(comment) < 12:
            continue
        call = signature[signature.index("def ") + 4:]
        call = call.split("->")[0].strip()
        choice = _hash(relpath, node.name) % 4
        if sentence and choice == 0:
            request = f"Write a Python function `{call}` that {_instruction(sentence)}"
        elif sentence and choice == 1:
            request = f"{signature}:\n    \"\"\"{sentence}\"\"\""
        elif choice == 2 or not sentence:
            basis = comment if len(comment) >= 12 else sentence
            request = f"{basis[:1].upper() + basis[1:]}\nName the function `{node.name}`."
        else:
            request = f"{signature}:"
        out.append(chat_text(request, f"```python\n{source}\n```"))
    return out


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for example in examples_from_source(path, f.read()):
                print(example)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
