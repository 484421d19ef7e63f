"""Reports of training runs: JSON, a Markdown table and PNG plots (matplotlib).

Every figure in a table is read from the run's measurements; nothing is typed in.
"""
from __future__ import annotations

import json
import os
import statistics


def _count(v):
    return "n/a" if v is None else f"{v:.0f}"


def _mib(b):
    return "n/a" if b is None else f"{b / 2**20:.3f}"


def _rank_max(report, key):
    values = [r["memory"][key] for r in report["per_rank"] if r["memory"] and key in r["memory"]]
    return max(values) if values else None


def summary_row(report: dict, baseline: dict | None = None) -> dict:
    """The headline figures of one run (worst rank for memory), with ratios to a baseline."""
    final = report["final"]
    main = final["full"] if "full" in final else final["subnetwork"]  # a simulated rank has only its own
    quality = main["accuracy"] if report["task"] == "classification" else main["loss"]
    row = {
        "run": report["label"],
        "quality": quality,
        "ensemble": final.get("ensemble", {}).get("accuracy" if report["task"] == "classification" else "loss"),
        "model_state_bytes": _rank_max(report, "model_state"),
        "param_bytes": _rank_max(report, "parameters"),
        "grad_bytes": _rank_max(report, "gradients"),
        "optim_bytes": _rank_max(report, "optimizer_state"),
        "activation_bytes": max((r["activation_bytes"] or 0) for r in report["per_rank"]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in report["per_rank"]),
        "comm_bytes_per_step": report["comm"]["bytes_per_step"],
        "collectives_per_step": report["comm"]["collectives_per_step"],
        "comm_source": report["comm"].get("source", ""),
        "step_time_s": report["step_time_s"],
        "throughput": report["throughput_per_s"],
    }
    if baseline is not None:
        base = summary_row(baseline)
        for key in ("model_state_bytes", "comm_bytes_per_step", "step_time_s", "activation_bytes"):
            row[f"{key}_vs_base"] = row[key] / base[key] if base[key] else None
        row["quality_minus_base"] = row["quality"] - base["quality"]
    return row


def markdown_table(reports: list[dict], baseline_label: str = "ddp") -> str:
    """One row per run. Ratio and difference columns against the run labelled `baseline_label`
    only when it is among `reports` beside other runs (a comparison that was made); the
    ensemble column only when some run evaluated an ensemble."""
    base = next((r for r in reports if r["label"] == baseline_label), None)
    compared = base is not None and len(reports) > 1
    task = reports[0]["task"]
    qname = "test acc" if task == "classification" else "eval loss"
    rows = [summary_row(rep, base if compared else None) for rep in reports]
    fmt_q = (lambda v: "n/a" if v is None else (f"{100 * v:.2f}%" if task == "classification" else f"{v:.4f}"))

    def ratio(key):
        return lambda r: "n/a" if r.get(key) is None else f"{r[key]:.3f}"

    def delta(r):
        d = r.get("quality_minus_base")
        return "n/a" if d is None else (f"{100 * d:+.2f} pp" if task == "classification" else f"{d:+.4f}")

    versus = f"×{baseline_label}"
    columns = [("run", lambda r: r["run"]), (f"{qname} (full)", lambda r: fmt_q(r["quality"]))]
    if any(r["ensemble"] is not None for r in rows):
        columns.append((f"{qname} (ensemble)", lambda r: fmt_q(r["ensemble"])))
    if compared:
        columns.append((f"Δ vs {baseline_label}", delta))
    columns.append(("model state MiB/rank", lambda r: _mib(r["model_state_bytes"])))
    if compared:
        columns.append((versus, ratio("model_state_bytes_vs_base")))
    columns += [("params", lambda r: _mib(r["param_bytes"])), ("grads", lambda r: _mib(r["grad_bytes"])),
                ("optim", lambda r: _mib(r["optim_bytes"])), ("activations MiB", lambda r: _mib(r["activation_bytes"])),
                ("comm MiB/step", lambda r: _mib(r["comm_bytes_per_step"]))]
    if compared:
        columns.append((versus, ratio("comm_bytes_per_step_vs_base")))
    columns += [("collectives/step", lambda r: f"{r['collectives_per_step']:.1f}"),
                ("step ms", lambda r: f"{1e3 * r['step_time_s']:.2f}")]
    if compared:
        columns.append((versus, ratio("step_time_s_vs_base")))
    columns.append((f"{reports[0]['throughput_unit']}/s", lambda r: _count(r["throughput"])))
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(f(r) for _, f in columns) + " |" for r in rows]
    sources = sorted({r["comm_source"] for r in rows})
    lines.append("")
    lines.extend(_training_lines(reports))
    lines.append("Memory: worst rank, bytes of parameters + gradients + optimizer state held by that rank; "
                 "activations: bytes saved for backward in one step (tensor accounting). "
                 "Comm: bytes handed to collectives per step (" + "; ".join(sources) + ").")
    return "\n".join(lines)


def _training_lines(reports: list[dict]) -> list[str]:
    """One line of optimizer-step settings, or one per run when they differ."""
    settings = {rep["label"]: rep.get("training") for rep in reports if rep.get("training")}
    if not settings:
        return []
    fmt = lambda t: ", ".join(f"{k} {v}" for k, v in t.items())  # noqa: E731
    if len({json.dumps(t, sort_keys=True) for t in settings.values()}) == 1:
        return [f"Training: {fmt(next(iter(settings.values())))}.", ""]
    return [f"Training ({label}): {fmt(t)}." for label, t in settings.items()] + [""]


def mean_std(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0.0 for a single value)."""
    if not values:
        raise ValueError("mean_std: no values")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def seeds_table(by_seed: dict[int, list[dict]], baseline_label: str = "ddp") -> str:
    """Mean ± std over seeds of each run's quality, and of its paired per-seed difference
    to the baseline run of the same seed. by_seed: {seed: [report, ...]} (same labels per seed)."""
    seeds = sorted(by_seed)
    kind = by_seed[seeds[0]][0]["task"]
    scale, unit = (100.0, " pp") if kind == "classification" else (1.0, "")
    qname = "test acc %" if kind == "classification" else "eval loss"
    quality = {}  # label -> {seed: quality}
    for seed in seeds:
        for rep in by_seed[seed]:
            quality.setdefault(rep["label"], {})[seed] = summary_row(rep)["quality"]
    lines = [f"| run | {qname} (full), mean ± std | Δ vs {baseline_label} (paired), mean ± std | seeds |",
             "|---|---|---|---|"]
    base = quality.get(baseline_label, {})
    for label, per_seed in quality.items():
        digits = 2 if kind == "classification" else 4
        m, s = mean_std([scale * per_seed[k] for k in seeds if k in per_seed])
        paired = [scale * (per_seed[k] - base[k]) for k in seeds if k in per_seed and k in base]
        if paired:
            dm, ds = mean_std(paired)
            delta = f"{dm:+.{digits}f} ± {ds:.{digits}f}{unit}"
        else:
            delta = "n/a"
        lines.append(f"| {label} | {m:.{digits}f} ± {s:.{digits}f} | {delta} | {len(per_seed)} |")
    lines.append("")
    lines.append("std: sample standard deviation over seeds; Δ: the per-seed difference to the "
                 f"{baseline_label} run of the same seed, then its mean and std.")
    return "\n".join(lines)


def plot_runs(reports: list[dict], path_prefix: str) -> list[str]:
    """Loss curves and memory per rank by method; returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for rep in reports:
        h = rep["history"]
        ax.plot(h["step"], _smooth(h["loss"]), label=rep["label"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0, smoothed)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(f"{path_prefix}loss.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [rep["label"] for rep in reports]
    parts = [("parameters", "params"), ("gradients", "grads"), ("optimizer_state", "optimizer")]
    bottom = [0.0] * len(reports)
    for key, name in parts:
        values = [(_rank_max(rep, key) or 0) / 2**20 for rep in reports]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("model-state MiB per rank (worst rank)")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(f"{path_prefix}memory.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _smooth(xs, k=10):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc = x if i == 0 else acc + (x - acc) / min(k, i + 1)
        out.append(acc)
    return out


def write_run_report(report: dict, out_dir: str) -> None:
    """report.json, report.md, loss.png and memory.png for one run."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(markdown_table([report], baseline_label=report["label"]) + "\n")
    plot_runs([report], os.path.join(out_dir, ""))
