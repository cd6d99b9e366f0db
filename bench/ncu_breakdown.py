#!/usr/bin/env python3
"""Where a pass's GPU time goes, by kernel: reads `ncu --csv --page raw --metrics gpu__time_duration.sum`
output (one row per launch) and prints, per kernel (template arguments kept, parameters dropped), the
launches, the mean and total time, and the share of the total, largest first.

    ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum \
        bench_cuda --shape 9B --profile-steps 1 > ncu.csv
    python3 bench/ncu_breakdown.py ncu.csv
"""
import collections
import csv
import sys


def rows(path):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    reader = csv.reader(lines)
    header = next(reader)
    name, time = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    units = next(reader)
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[units[time]]
    for r in reader:
        yield short_name(r[name]), float(r[time].replace(",", "")) * scale


def short_name(kernel):
    """'void a::(anonymous namespace)::k<1, 2>(args)' -> 'k<1, 2>'."""
    kernel = kernel.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").split("(")[0].removeprefix("void ")
    base, _, args = kernel.partition("<")
    return base.split("::")[-1] + ("<" + args if args else "")


def main():
    total = collections.defaultdict(float)
    count = collections.Counter()
    for kernel, us in rows(sys.argv[1]):
        total[kernel] += us
        count[kernel] += 1
    grand = sum(total.values())
    print(f"{sum(count.values())} launches, {grand:.1f} us of kernel time")
    print("| kernel | launches | mean us | total us | share |")
    print("|---|---|---|---|---|")
    for kernel, us in sorted(total.items(), key=lambda kv: -kv[1]):
        short = kernel if len(kernel) < 90 else kernel[:87] + "..."
        print(f"| {short} | {count[kernel]} | {us / count[kernel]:.2f} | {us:.1f} | {100 * us / grand:.1f}% |")


if __name__ == "__main__":
    main()
