"""The study's plots: validation loss against steps, FLOPs and seconds, and memory per rank
against loss with the Pareto front (lower memory and lower loss) marked."""
from __future__ import annotations

import os

from study_results import Results

MIB = 2 ** 20


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _families(res: Results, task: str, k: int) -> list[tuple[str, list[str]]]:
    """(title, runs) per coverage: DDP, stochastic depth and the SDP runs of that coverage."""
    names = [n for n in res.names(task, k) if "+" not in n]
    coverages = sorted({n.rsplit("-c", 1)[1] for n in names if n.startswith("sdp-")}, key=float, reverse=True)
    return [(f"C = {c}", ["ddp"] + [n for n in names if n != "ddp" and n.endswith(f"-c{c}")]) for c in coverages]


def plot_curves(res: Results, task: str, k: int, folder: str) -> list[str]:
    """Validation loss (mean over seeds) vs step, FLOPs and training seconds; one column per coverage."""
    plt = _plt()
    families = _families(res, task, k)
    if not families:
        return []
    axes_x = [("step", "optimizer step"), ("flops", "FLOPs (all ranks)"), ("seconds", "training seconds")]
    fig, axes = plt.subplots(len(axes_x), len(families), figsize=(6 * len(families), 3.6 * len(axes_x)), squeeze=False)
    for col, (title, names) in enumerate(families):
        for row, (x, label) in enumerate(axes_x):
            ax = axes[row][col]
            for name in names:
                xs, ys = res.mean_curve(task, k, name, x)
                style = "--" if name.startswith("ddp") and name != "ddp" else "-"
                ax.plot(xs[1:], ys[1:], style, label=name, linewidth=1.2)  # from the first evaluation after init
            ax.set_xlabel(label)
            _label(ax, "val loss (full model)", f"{task}, K={k}, {title}", legend=row == 0)
    return [_save(plt, fig, os.path.join(folder, f"{task}-K{k}-curves.png"))]


def _label(ax, ylabel: str, title: str, legend: bool = True) -> None:
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points no other point beats on both memory and loss (ties kept), sorted by memory."""
    front = [p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and (q[0], q[1]) != (p[0], p[1])
                                          for q in points)]
    return sorted(front)


def memory_points(res: Results, task: str, k: int, protocol: str) -> list[tuple[float, float, float, str]]:
    """(model state + activations MiB of the worst rank, mean loss, std, run) per run at a protocol."""
    out = []
    for name in res.names(task, k):
        c = res.cost(task, k, name)
        s = res.summary(task, k, name, protocol)
        if s["n"]:
            out.append(((c["model_state"] + c["activations"]) / MIB, s["mean"], s["std"], name))
    return out


def plot_memory_vs_loss(res: Results, task: str, k: int, folder: str) -> list[str]:
    """Memory per rank vs loss, one point per run, the Pareto front joined; equal iterations and FLOP-matched."""
    plt = _plt()
    panels = [("tokens", "equal iterations"), ("flops", "FLOP-matched")]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (protocol, title) in zip(axes[0], panels):
        points = memory_points(res, task, k, protocol)
        for mem, loss, std, name in points:
            ax.errorbar(mem, loss, yerr=0 if std != std else std, fmt="o", markersize=4, capsize=2)
            ax.annotate(name, (mem, loss), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front = pareto_front([(m, l, n) for m, l, _, n in points])
        ax.plot([p[0] for p in front], [p[1] for p in front], "r-", linewidth=1, label="Pareto front")
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=60, facecolors="none", edgecolors="r")
        ax.set_xlabel("per-rank memory: model state + activations, MiB (worst rank)")
        _label(ax, "val loss (full model), mean ± std", f"{task}, K={k}, {title}")
    return [_save(plt, fig, os.path.join(folder, f"{task}-K{k}-memory.png"))]
