"""Draw a plan's sweep: predicted latency and throughput at every cut, limits and choice."""

from __future__ import annotations

from pathlib import Path

from pagedllm.partition.plan import PartitionPlan


def plot_plan(plan: PartitionPlan, path: str | Path) -> None:
    """Per-token latency (left axis) and tokens/s (right axis) for every candidate cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = plan.candidates
    if not cands:
        raise ValueError("the plan has no candidates to plot (analyze() fills them)")
    labels = [",".join(str(k) for k in c.cuts) for c in cands]
    x = list(range(len(cands)))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(x) + 3), 4.2))
    ax.plot(x, [c.decode_latency_ms for c in cands], "o-", color="tab:blue", label="latency")
    ax.set_xlabel("cut (first layer of the next tier)")
    ax.set_ylabel("predicted decode latency (ms/token)", color="tab:blue")
    right = ax.twinx()
    right.plot(x, [c.tokens_per_s for c in cands], "s-", color="tab:green", label="tok/s")
    right.plot(
        x, [c.cloud_tokens_per_s for c in cands], "^--", color="tab:olive", label="cloud tok/s"
    )
    right.set_ylabel("predicted tokens/s", color="tab:green")
    for check in plan.chosen.checks:
        if check.name == "max_edge_latency":
            ax.axhline(check.limit, color="tab:blue", ls=":", label="max_edge_latency")
        elif check.name == "min_cloud_throughput":
            right.axhline(check.limit, color="tab:olive", ls=":", label="min_cloud_throughput")
    chosen = cands.index(next(c for c in cands if c.cuts == plan.cuts))
    ax.axvline(chosen, color="tab:red", alpha=0.5, lw=6, label="chosen")
    infeasible = [i for i, c in enumerate(cands) if not c.feasible]
    ax.plot(
        infeasible,
        [cands[i].decode_latency_ms for i in infeasible],
        "x",
        color="black",
        label="misses a constraint",
    )
    ax.set_xticks(x, labels, rotation=90 if len(x) > 16 else 0)
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], fontsize=8, loc="best")
    title = f"{Path(plan.model).name}: {plan.strategy}, batch {plan.batch_size}"
    ax.set_title(title if plan.feasible else title + " (infeasible)")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
