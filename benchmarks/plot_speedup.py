"""Speedup-vs-size PNG from one of our benchmark tables (markdown, as the benchmark scripts write them).

    python benchmarks/plot_speedup.py OUT/dense.md benchmarks/plots/dense_h200.png --title "..." --target 1.5

A table row gives: group columns (e.g. the shape) before the size column (M, tokens or concurrency),
and one series per column holding a ratio, written ``1.23x`` or ``12.3 (1.23x)``. One panel per group,
speedup on a linear axis, size on a log axis, 1.0x (and an optional target) drawn across. Needs matplotlib.
"""

import argparse
import re
from collections import defaultdict
from pathlib import Path

SIZE_HEADERS = ("m", "tokens", "concurrency", "batch")
RATIO = re.compile(r"(?:\(|^)([0-9.]+)x\)?$")


def first_table(text: str):
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and i + 1 < len(lines)
                 and re.fullmatch(r"\|[\s:|-]+\|", lines[i + 1]))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[0], rows[2:]


def series_of(header, rows):
    """{group: {series: [(size, ratio), ...]}}"""
    size_col = next(i for i, h in enumerate(header) if h.lower() in SIZE_HEADERS)
    out = defaultdict(lambda: defaultdict(list))
    for row in rows:
        group = " ".join(row[:size_col]) or "all"
        size = float(row[size_col])
        for j, cell in enumerate(row):
            m = RATIO.search(cell)
            if j != size_col and m:
                name = re.sub(r"\s*(us|tok/s)?\s*\((ratio|speedup)\)$", "", header[j]).strip()
                out[group][name].append((size, float(m.group(1))))
    return size_col, out


def plot(table: Path, png: Path, title: str, target=None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, rows = first_table(table.read_text())
    size_col, groups = series_of(header, rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6.5, 4.2 * len(groups)), 3.6), squeeze=False, sharey=True)
    for ax, (group, series) in zip(axes[0], groups.items()):
        for name, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        if target:
            ax.axhline(target, color="green", lw=1, ls=":", label=f"target {target}x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(header[size_col])
        ax.set_title(group, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("speedup vs baseline (same run)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    return png


def plot_beside(table: Path, title: str, target=None) -> None:
    """For the benchmark scripts: TABLE.png beside TABLE.md, or a line saying how to make it later."""
    table = Path(table)
    try:
        print("plot:", plot(table, table.with_suffix(".png"), title, target))
    except ImportError:
        print(f"matplotlib is not installed here: python benchmarks/plot_speedup.py {table} {table.with_suffix('.png')}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("png")
    ap.add_argument("--title", default="")
    ap.add_argument("--target", type=float, default=None)
    args = ap.parse_args()
    print(plot(Path(args.table), Path(args.png), args.title, args.target))


if __name__ == "__main__":
    main()
