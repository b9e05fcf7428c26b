"""Charts of the quantization and tensor-parallel figures recorded in the repository.

The benchmarks behind these figures (quant.py, tp_overlap.py) print markdown tables, which
were recorded in benchmarks/results/*.md and BENCHMARKS.md together with the machine and the
command; this script reads those tables back and draws them, so a chart shows exactly the
recorded numbers and nothing else. Re-running a benchmark and recording its tables redraws
the chart.

    python benchmarks/plot_results.py            # writes the three PNGs below
    python benchmarks/plot_results.py --out-dir /tmp/charts

- benchmarks/results/int8.png: int8 vs bf16 / fp32 engines on the 125M benchmark model
  (benchmarks/results/quant.md);
- benchmarks/results/quant_methods.png: int8 and int4 on SmolLM2-135M and the demo model
  (BENCHMARKS.md, "Quantization methods on a real model");
- benchmarks/results/tp.png: TP=2 communication overlap on / off (benchmarks/results/tp.md).
"""

from __future__ import annotations

import argparse
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

Table = list[dict[str, str]]


def section(text: str, heading: str) -> str:
    """The text under the heading that starts with `heading`, up to the next heading of the
    same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"(#+) ", line)
        if match and line[match.end() :].startswith(heading):
            level = len(match.group(1))
            end = next(
                (j for j in range(i + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[j])),
                len(lines),
            )
            return "\n".join(lines[i + 1 : end])
    raise ValueError(f"no heading starting with {heading!r}")


def tables(text: str) -> list[Table]:
    """Every markdown table of `text`, as rows keyed by the header's cells."""
    found: list[Table] = []
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) > 2:  # header, separator, rows
            found.append([dict(zip(block[0], row)) for row in block[2:]])
        block = []
    return found


def number(cell: str) -> float:
    """The first number of a cell: '**100.30%**' -> 100.3, '9.5 (0.253x)' -> 9.5."""
    match = re.search(r"-?\d+(?:\.\d+)?", cell.replace(",", ""))
    if match is None:
        raise ValueError(f"no number in table cell {cell!r}")
    return float(match.group())


def column(table: Table, name: str) -> list[float]:
    if name not in table[0]:
        raise ValueError(f"no column {name!r}; the table has {list(table[0])}")
    return [number(row[name]) for row in table]


def label(cell: str) -> str:
    return cell.replace("`", "").replace("*", "")


def short(cell: str) -> str:
    """A method's label without the flag: '`--quantization int4` (group 32)' -> 'int4 (group
    32)'."""
    return label(cell).replace("--quantization ", "")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _caption(fig, text: str) -> None:
    fig.text(0.01, 0.01, text, fontsize=7.5, va="bottom", ha="left", family="monospace")


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


def plot_int8(out: Path) -> None:
    engine = tables(section((RESULTS / "quant.md").read_text(), "Engine decode throughput"))[0]
    names = [label(r["engine"]).replace(" (", "\n(") for r in engine]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, name, unit in (
        (axes[0], "decode tok/s", "decode tokens / s (batch 32)"),
        (axes[1], "weight MB", "weight MB"),
    ):
        values = column(engine, name)
        bars = ax.barh(names, values, color=["#888", "#d62728", "#ff7f0e", "#1f77b4"])
        ax.bar_label(bars, [f"{v:g}" for v in values], padding=3, fontsize=8)
        ax.set_xlabel(unit)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.18)
    axes[1].set_yticklabels([])
    fig.suptitle("int8 engines on the 125M benchmark model (random weights, 32 requests)")
    _caption(
        fig,
        "2-core AMD EPYC (Zen 3 under KVM, AVX2 only: slow bf16), torch 2.13.0 CPU, "
        "1 torch thread, load 6-7 (shared)\n"
        "nice -n 5 python benchmarks/quant.py kernels engine --rows 32 256 2048 "
        "--profile   (benchmarks/results/quant.md)",
    )
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    _save(fig, out / "int8.png")


def plot_quant_methods(out: Path) -> None:
    text = section((ROOT / "BENCHMARKS.md").read_text(), "Quantization methods on a real model")
    accuracy, kernels, decode = tables(text)[:3]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), width_ratios=(1, 1.1, 1.2))

    # "SmolLM2\nint4\n(group 32)": the model's first word over the method
    names = [
        "\n".join([label(r["model"]).split("-")[0].split(" ")[0], short(r["method"])])
        for r in accuracy
    ]
    names = [n.replace(" (", "\n(") for n in names]
    retention = column(accuracy, "top-1 retention")
    bars = axes[0].bar(names, retention, color=["#d62728", "#9467bd"] * 2)
    sizes = column(accuracy, "weights vs fp32")
    axes[0].bar_label(
        bars,
        [f"{r:.2f}%\nweights {s:g}x" for r, s in zip(retention, sizes)],
        fontsize=7.5,
        padding=2,
    )
    axes[0].set_ylim(98, 101.2)
    axes[0].axhline(100, color="k", lw=0.6)
    axes[0].set_ylabel("top-1 accuracy retention vs fp32 (%)")
    axes[0].set_title("accuracy (load 5.3-8.1)", fontsize=10)
    axes[0].tick_params(axis="x", labelsize=8)

    rows = column(kernels, "rows")
    for name in list(kernels[0])[1:]:
        axes[1].plot(rows, column(kernels, name), "o-", label=label(name))
    axes[1].set_xticks(rows)
    axes[1].set_xlabel("rows (tokens) per product")
    axes[1].set_ylabel("microseconds per call")
    axes[1].set_title("one gate_up product, 576 -> 3072 (load 0.8)", fontsize=10)
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)

    settings = [textwrap.fill(short(r["setting"]), 30) for r in decode]
    speed = column(decode, "out tok/s")
    bars = axes[2].barh(settings, speed, color=["#888", "#d62728", "#ff7f0e", "#9467bd"])
    axes[2].bar_label(bars, [f"{v:g}" for v in speed], padding=3, fontsize=8)
    axes[2].invert_yaxis()
    axes[2].set_xlim(0, max(speed) * 1.18)
    axes[2].set_xlabel("output tokens / s, one request")
    axes[2].set_title("SmolLM2 engine decode, batch 1 (load 1.2-1.6)", fontsize=10)
    axes[2].tick_params(axis="y", labelsize=8)

    fig.suptitle("int8 and int4 on SmolLM2-135M-Instruct and the demo model")
    _caption(
        fig,
        "2-core AMD EPYC (Zen 4 under KVM, AVX-512 + VNNI), shared; "
        "SM=~/.cache/pagedllm/smollm2-135m-instruct/hf-fp32   (BENCHMARKS.md)\n"
        "accuracy: pagedllm quantize-eval --model SM --dtype float32 --max-tokens "
        "4000 --json;  python benchmarks/quant.py accuracy --window 511 --max-tokens "
        "8000 --threads 2\n"
        "products: python benchmarks/quant.py weight-only --threads 1;  "
        "decode: python benchmarks/quant.py decode --threads 2 --model SM",
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    _save(fig, out / "quant_methods.png")


def tp_runs() -> list[tuple[str, Table]]:
    """(name, step table) per recorded run of tp_overlap.py, in the order of tp.md."""
    text = (RESULTS / "tp.md").read_text()
    runs = [
        ("bf16 run 1 (earlier script)", tables(section(text, "bf16 — run 1"))[0]),
        ("bf16 run 2", tables(section(text, "bf16 (default) — run 2"))[0]),
    ]
    fp32 = tables(section(text, "fp32 — runs 2 and 3"))
    runs += [("fp32 run 2", fp32[0]), ("fp32 run 3", fp32[2])]  # step, forward, step, forward
    return runs


def fp32_run1() -> tuple[list[float], list[float]]:
    """fp32 run 1's on / off ratios, recorded in a sentence of tp.md, not in a table."""
    text = (RESULTS / "tp.md").read_text()
    match = re.search(r"fp32 run 1 .*?gave on / off (.*?)\.\n", text, re.S)
    if match is None:
        raise ValueError("tp.md: no sentence with fp32 run 1's on / off ratios")
    pairs = re.findall(r"(\d+\.\d+) \(B = (\d+)\)", match.group(1))
    return [float(b) for _, b in pairs], [float(r) for r, _ in pairs]


def plot_tp(out: Path) -> None:
    runs = tp_runs()
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    styles = {"bf16": "s--", "fp32": "o-"}
    for name, table in runs:
        batch = column(table, "batch")
        style = styles[name[:4]]
        axes[0].plot(batch, column(table, "on / off"), style, label=name)
        axes[1].plot(batch, column(table, "tok/s off"), style, label=name)
        axes[2].plot(batch, column(table, "comm share of step off"), style, label=name)
    batch, ratio = fp32_run1()
    axes[0].plot(batch, ratio, "o:", label="fp32 run 1 (earlier script)")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].axhspan(0.95, 1.15, color="0.85", zorder=0, label="B = 1 spread (noise)")
    axes[0].set_ylabel("decode step, overlap on / off (< 1: overlap faster)")
    axes[0].set_title("communication overlap on / off")
    axes[1].set_ylabel("output tokens / s, overlap off")
    axes[1].set_title("throughput with the batch")
    axes[2].set_ylabel("all-reduce alone / step (%)")
    axes[2].set_title("communication's share of a step")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 8, 32, 64], ["1", "8", "32", "64"])
        ax.set_xlabel("batch (sequences per decode step)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7.5)
    fig.suptitle(
        "Tensor parallel TP=2 (gloo over loopback, 1 thread per rank), 125M Llama benchmark model"
    )
    _caption(
        fig,
        "2-core AMD EPYC (Zen 3 under KVM, AVX2 only), 24 GiB, torch 2.13.0 CPU, "
        "load 5-9 (shared)   (benchmarks/results/tp.md)\n"
        "nice -n 5 python benchmarks/tp_overlap.py  (bf16);  "
        "nice -n 5 python benchmarks/tp_overlap.py --dtype float32 --rounds 24",
    )
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    _save(fig, out / "tp.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    plot_int8(args.out_dir)
    plot_quant_methods(args.out_dir)
    plot_tp(args.out_dir)


if __name__ == "__main__":
    main()
