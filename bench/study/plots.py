"""The study's plots: validation loss of the stable trajectories against steps and FLOPs (each
protocol's cooled-down mark drawn as a point), and peak memory per rank against loss with the
Pareto front (lower memory and lower loss) marked."""
from __future__ import annotations

import os

from .results import Results


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _families(res: Results, task: str, k: int) -> list[tuple[str, list[str]]]:
    """(title, runs) per coverage: DDP, the dense controls and stochastic depth of that size, and the SDP runs of
    that coverage that have a trajectory of their own."""
    from .analysis import dense_control_of

    names = [n for n in res.verdict_runs(task, k) if not res.config(task, k, n).get("derived_from")]
    sdp = [n for n in names if n.startswith("sdp-")]
    coverages = sorted({res.config(task, k, n)["coverage"] for n in sdp}, reverse=True)
    out = []
    for c in coverages:
        runs = [n for n in sdp if res.config(task, k, n)["coverage"] == c]
        controls = {dense_control_of(res.config(task, k, n), names) for n in runs} - {None}
        extra = ["ddp-halfbatch", "ddp-sd-c0.5"] if c == 0.5 else []
        out.append((f"C = {c:g}", ["ddp", *sorted(controls), *[n for n in extra if n in names], *runs]))
    return out


def plot_anchor(res: Results, task: str, folder: str, published: float) -> str | None:
    """The recipe's validation loss against iterations (mean over seeds), in one process and on K ranks, with
    the study's DDP and nanoGPT's published figure as a line."""
    from .runs import MAIN_K

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for k, name, label in ((1, "recipe", "recipe, one process"), (MAIN_K, "recipe", f"recipe, {MAIN_K} ranks"),
                           (MAIN_K, "ddp", f"study's DDP (stable trajectory), {MAIN_K} ranks")):
        if not res.seeds(task, k, name):
            continue
        xs, ys = res.mean_curve(task, k, name, "step")
        ax.plot(xs[1:], ys[1:], label=label, linewidth=1.2)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.axhline(published, color="k", linestyle=":", label=f"nanoGPT's README: about {published}")
    ax.set_xlabel("iteration")
    _label(ax, "val loss (every validation window)", f"{task}: nanoGPT's recipe reproduced")
    return _save(plt, fig, os.path.join(folder, f"{task}-anchor-curves.png"))


def plot_curves(res: Results, task: str, k: int, folder: str) -> list[str]:
    """Validation loss (mean over seeds) vs step and FLOPs; one column per coverage; the marks as points."""
    plt = _plt()
    families = _families(res, task, k)
    if not families:
        return []
    axes_x = [("step", "optimizer step"), ("flops", "FLOPs (all ranks)")]
    fig, axes = plt.subplots(len(axes_x), len(families), figsize=(6 * len(families), 3.6 * len(axes_x)), squeeze=False)
    for col, (title, names) in enumerate(families):
        for row, (x, label) in enumerate(axes_x):
            ax = axes[row][col]
            for name in names:
                xs, ys = res.mean_curve(task, k, name, x)
                line, = ax.plot(xs[1:], ys[1:], "--" if name.startswith("ddp-") else "-", label=name, linewidth=1.2)
                for protocol, marker in (("tokens", "o"), ("flops", "s")):
                    pts = [res.point(task, k, s, name, protocol) for s in res.seeds(task, k, name)]
                    pts = [p for p in pts if p]
                    if pts:
                        ax.scatter([sum(p[x] for p in pts) / len(pts)], [sum(p["loss"]["full"] for p in pts) / len(pts)],
                                   marker=marker, color=line.get_color(), s=18)
            ax.set_xlabel(label)
            _label(ax, "val loss (full model)", f"{task}, K={k}, {title}; o/□: equal tokens/FLOPs marks after cooldown",
                   legend=row == 0)
    return [_save(plt, fig, os.path.join(folder, f"{task}-K{k}-curves.png"))]


def _label(ax, ylabel: str, title: str, legend: bool = True) -> None:
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=8)
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


def memory_points(a: dict, protocol: str) -> list[tuple[float, float, float, str]]:
    """(peak memory per rank x DDP's, mean loss, std, run) of DDP and every run a user could choose."""
    out = []
    for name, e in [("ddp", a["ddp"]), *a["runs"].items()]:
        pe = e["protocols"].get(protocol)
        if pe:
            out.append((1.0 if name == "ddp" else e["memory"], pe["loss"], pe["std"], name))
    return out


def plot_memory_vs_loss(res: Results, a: dict, task: str, k: int, folder: str) -> list[str]:
    """Peak memory per rank vs loss, one point per run, the Pareto front joined; equal tokens and equal FLOPs."""
    plt = _plt()
    panels = [("tokens", "equal tokens"), ("flops", "equal FLOPs")]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (protocol, title) in zip(axes[0], panels):
        points = memory_points(a, protocol)
        for mem, loss, std, name in points:
            ax.errorbar(mem, loss, yerr=0 if std != std else std, fmt="o", markersize=4, capsize=2)
            ax.annotate(name, (mem, loss), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front = pareto_front([(m, l, n) for m, l, _, n in points])
        ax.plot([p[0] for p in front], [p[1] for p in front], "r-", linewidth=1, label="Pareto front")
        ax.scatter([p[0] for p in front], [p[1] for p in front], s=60, facecolors="none", edgecolors="r")
        ax.set_xlabel("peak memory per rank of one step, × DDP's (worst rank)")
        _label(ax, "val loss (full model), mean ± std over seeds", f"{task}, K={k}, {title}")
    return [_save(plt, fig, os.path.join(folder, f"{task}-K{k}-memory.png"))]
