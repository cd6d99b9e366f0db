#!/usr/bin/env python3
"""Runs `mtpx generate` and `mtpx inspect` on every hostile model directory that
scripts/make_hostile_models.py writes, and checks each run: the expected outcome (exit code 2 with one
line `error: ...` naming the problem, or a normal run), no crash (no signal), no hang (each run is killed
after --timeout seconds) and no allocation storm (peak RSS, from wait4, under the case's limit: 100 MiB, 320 MiB for the largest header accepted).

    python3 tests/hostile/test_hostile_models.py --binary build/mtpx [--corpus DIR] [--markdown]

--markdown prints the results as a table (RELIABILITY.md). Exit code 0 when every run passes.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import make_hostile_models  # noqa: E402


def run_measured(command, timeout):
    """(exit code or -signal, stdout, stderr, peak RSS in bytes, seconds); a run past `timeout` is killed
    and reported as 'timeout'."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        process = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid != 0:
                break
            if time.monotonic() - start > timeout:
                timed_out = True
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.01)
        process.returncode = 0  # reaped above; keeps Popen from waiting again
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        code = "timeout" if timed_out else (os.WEXITSTATUS(status) if os.WIFEXITED(status)
                                            else -os.WTERMSIG(status))
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace"), \
            usage.ru_maxrss * 1024, seconds


def check(expected, code, out, err):
    """Problems with one run (empty list: as expected)."""
    kind, needle = expected
    problems = []
    if code == "timeout":
        return ["hung (killed)"]
    if isinstance(code, int) and code < 0:
        return [f"killed by signal {-code} ({signal.Signals(-code).name})"]
    if kind == "error":
        if code != 2:
            problems.append(f"exit code {code}, expected 2")
        if out:
            problems.append(f"stdout not empty: {out[:200]!r}")
        if not err.startswith("error: ") or err.count("\n") != 1:
            problems.append(f"stderr is not one 'error: ' line: {err[:300]!r}")
        if needle and needle not in err:
            problems.append(f"'{needle}' not in: {err.strip()[:300]}")
    else:
        if code != 0:
            problems.append(f"exit code {code}, expected 0: {err.strip()[:300]}")
        if needle and needle not in out:
            problems.append(f"'{needle}' not in the output: {out[:300]!r}")
    return problems


def commands(binary, directory, case):
    """The runs of one case: generate (greedy, a few tokens, ids since synth has no tokenizer) and inspect
    (with --check-values, which reads every weight, where the case is about weight values)."""
    inspect = [binary, "inspect", directory, "--json"]
    if case.get("check_values"):
        inspect.append("--check-values")
    return {
        "generate": [binary, "generate", "--model", directory, "--prompt-ids", "1,2,3", "--max-tokens", "4",
                     "--temperature", "0", "--json"],
        "inspect": inspect,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", required=True)
    parser.add_argument("--corpus", help="where to write the corpus (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a run counts as hung")
    parser.add_argument("--markdown", action="store_true", help="print a results table")
    parser.add_argument("--only", help="run only the cases whose name contains this")
    parser.add_argument("--sanitized", action="store_true",
                        help="the binary is built with AddressSanitizer (scripts/test_sanitized.sh): its shadow "
                        "memory and redzones inflate RSS several times, so the RSS limits are not checked and "
                        "--timeout is multiplied by 4")
    args = parser.parse_args()
    if args.sanitized:
        args.timeout *= 4

    corpus = args.corpus or tempfile.mkdtemp(prefix="mtpx_hostile_")
    try:
        # In a child process: the corpus builder holds ~100 MB of strings, and a process forked from it
        # would report that as its own peak RSS.
        subprocess.run([sys.executable, make_hostile_models.__file__, "--mtpx", args.binary, "--out", corpus],
                       check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(corpus, "cases.json")) as f:
            cases = json.load(f)
        failures = 0
        rows = []
        for case in cases:
            if args.only and args.only not in case["name"]:
                continue
            directory = os.path.join(corpus, case["name"])
            outcome = {}
            for which, command in commands(args.binary, directory, case).items():
                code, out, err, rss, seconds = run_measured(command, args.timeout)
                problems = check(case[which], code, out, err)
                if not args.sanitized and rss > case["max_rss_mib"] * 2**20:
                    problems.append(f"peak RSS {rss / 2**20:.0f} MiB over {case['max_rss_mib']:.0f} MiB")
                outcome[which] = (code, err.strip() if code != 0 else "ok", rss, seconds, problems)
                status = "FAIL" if problems else "ok"
                print(f"[{status:4}] {case['name']:34} {which:8} exit {code!s:7} {rss / 2**20:6.0f} MiB "
                      f"{seconds:5.2f} s  {'; '.join(problems) or (err.strip() if code else '')}"[:400],
                      flush=True)
                failures += bool(problems)
            rows.append((case, outcome))
        if args.markdown:
            print("\n| case | what | `generate` | `inspect` | peak RSS (MiB) | passed |")
            print("|---|---|---|---|---|---|")
            for case, outcome in rows:
                def cell(which):
                    code, message, _, _, _ = outcome[which]
                    if code == 0:
                        if case["check_values"]:
                            return "exit 0; `--check-values` names the tensor"
                        needle = case[which][1]
                        return f"exit 0; the report says '{needle}'" if needle else "exit 0"
                    message = message.removeprefix("error: ").replace(os.path.join(corpus, case["name"]), "DIR")
                    message = message.replace("|", "\\|")
                    if len(message) > 160:
                        message = message[:157] + "..."
                    return f"exit {code}: {message}"
                rss = max(o[2] for o in outcome.values()) / 2**20
                passed = "yes" if not any(o[4] for o in outcome.values()) else "**no**"
                inspect = "same" if outcome["inspect"][1] == outcome["generate"][1] else cell("inspect")
                print(f"| {case['name']} | {case['what']} | {cell('generate')} | {inspect} | {rss:.0f} | {passed} |")
        print(f"{len(rows)} hostile model directories, {failures} failed runs")
        return 1 if failures else 0
    finally:
        if not args.corpus:
            shutil.rmtree(corpus, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
