"""The study's report: Markdown tables, plots and the generated verdict, from the results.

Every number in the report is read from the result JSONs (study_results.py); nothing is
typed in. Loss is validation cross-entropy in nats (per character on pysrc, per sample on
digits), of the full model unless a column says otherwise.
"""
from __future__ import annotations

import json
import math
import os

from study_results import PROTOCOL_TITLES, PROTOCOLS, Results

MIB = 2 ** 20
TASK_TITLES = {"pysrc": "Python sources, character-level GPT", "digits": "digits, residual MLP (the demo's task)"}


def fmt(v, digits=3, sign=False) -> str:
    """A number for a table ("n/a" for None or nan)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def pm(mean, std, digits=3, sign=False) -> str:
    """mean ± std ("± n/a" with one seed)."""
    return f"{fmt(mean, digits, sign)} ± {fmt(std, digits)}"


def _ratio(a, b) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def quality_table(res: Results, task: str, k: int) -> str:
    """Full-model loss and paired Δ to DDP at each protocol, and the steps each protocol's mark fell at."""
    head = "| run | " + " | ".join(f"{PROTOCOL_TITLES[p]}: loss | Δ vs ddp | steps" for p in PROTOCOLS) + " | seeds |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in res.names(task, k):
        if "+" in name:
            continue  # final phases: in the which-model table
        cells = []
        for p in PROTOCOLS:
            s = res.summary(task, k, name, p)
            steps = res.steps_at(task, k, name, p)
            span = "n/a" if not steps else (str(steps[0]) if min(steps) == max(steps) else f"{min(steps)}-{max(steps)}")
            span += " †" if res.not_reached(task, k, name, p) else ""
            cells.append(f"{pm(s['mean'], s['std'])} | {pm(s['delta'], s['delta_std'], sign=True)} | {span}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {res.summary(task, k, name, 'tokens')['n']} |")
    lines += ["", "Steps: where each seed's mark fell (a range over seeds). †: some seed had not reached DDP's "
              "training seconds after twice the steps the other protocols needed (the machine's load changed "
              "during the study); its value there is read at its last step."]
    return "\n".join(lines)


def keep_table(res: Results, task: str, k: int) -> str:
    """SDP runs at equal iterations: Δ to DDP of every model a user could keep."""
    modes = [("full", "full (union)"), ("full_scaled", "full, scaled by owner fraction"), ("ensemble", "ensemble"),
             ("subnetworks", "each rank's subnetwork: their mean (Δ); by rank 0 / 1 / ...")]
    sdp = [n for n in res.names(task, k) if n.startswith("sdp-") and "+" not in n]
    phases = sorted({n.split("+", 1)[1] for n in res.names(task, k) if "+" in n})
    head = "| run | " + " | ".join(t for _, t in modes) + "".join(f" | +{p}: full" for p in phases) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in sdp:
        cells = []
        for mode, _ in modes:
            s = res.summary(task, k, name, "tokens", mode)
            cells.append("n/a" if s["n"] == 0 else f"{fmt(s['mean'])} ({pm(s['delta'], s['delta_std'], sign=True)})")
        cells[-1] += "; by rank " + " / ".join(fmt(v) for v in res.subnetwork_losses(task, k, name, "tokens"))
        for p in phases:
            s = res.summary(task, k, f"{name}+{p}", "tokens")
            cells.append("—" if s["n"] == 0 else f"{fmt(s['mean'])} ({pm(s['delta'], s['delta_std'], sign=True)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cost_table(res: Results, task: str, k: int) -> str:
    """Measured per-rank memory (worst rank), communication, FLOPs and step time, each against DDP."""
    base = res.cost(task, k, "ddp")
    head = ("| run | model state MiB/rank | ×ddp | params / grads / optimizer MiB | activations MiB (max; mean) | ×ddp "
            "| peak RSS MiB | comm MiB/step | collectives/step | FLOPs/step ×ddp | step ms | ×ddp |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in res.names(task, k):
        c = res.cost(task, k, name)
        lines.append(
            f"| {name} | {c['model_state'] / MIB:.3f} | {_ratio(c['model_state'], base['model_state'])} "
            f"| {c['parameters'] / MIB:.3f} / {c['gradients'] / MIB:.3f} / {c['optimizer_state'] / MIB:.3f} "
            f"| {c['activations'] / MIB:.3f}; {c['activations_mean'] / MIB:.3f} "
            f"| {_ratio(c['activations'], base['activations'])} | {c['peak_rss'] / MIB:.0f} "
            f"| {(c['comm_bytes_per_step'] or 0) / MIB:.3f} | {fmt(c['collectives_per_step'], 1)} "
            f"| {_ratio(c['step_flops'], base['step_flops'])} | {1e3 * c['step_time_s']:.1f} "
            f"| {_ratio(c['step_time_s'], base['step_time_s'])} |")
    sources = sorted({res.cost(task, k, n)["comm_source"] for n in res.names(task, k)})
    lines.append("")
    lines.append("Memory: the worst rank's bytes, counted exactly (parameters, gradients and optimizer state as "
                 "held; activations: the bytes of tensors autograd saved for backward, over every step, max and "
                 "mean). Final phases report their own phase. FSDP2 also gathers a block's full parameters (in "
                 "backward, and its full gradients) while that block runs: transient, one or two blocks at a time, "
                 "not in its model state. Peak RSS: the process's high-water mark over that "
                 "configuration (Linux VmHWM, reset per configuration; it includes torch's own footprint). "
                 "Communication: bytes handed to collectives per step (" + "; ".join(sources) + "). FLOPs: counted "
                 "by torch's FlopCounterMode over a real step, summed over ranks.")
    return "\n".join(lines)


def accuracy_table(res: Results, task: str, k: int) -> str:
    """Classification tasks: accuracy at equal iterations of the full model and the ensemble."""
    lines = ["| run | test acc % (full) | Δ vs ddp pp | test acc % (ensemble) |", "|---|---|---|---|"]
    for name in res.names(task, k):
        s = res.summary(task, k, name, "tokens", "full", "accuracy")
        e = res.summary(task, k, name, "tokens", "ensemble", "accuracy")
        lines.append(f"| {name} | {pm(100 * s['mean'], 100 * s['std'], 2)} "
                     f"| {pm(100 * s['delta'], 100 * s['delta_std'], 2, sign=True)} "
                     f"| {'n/a' if e['n'] == 0 else pm(100 * e['mean'], 100 * e['std'], 2)} |")
    return "\n".join(lines)


def setup_section(res: Results, record: dict) -> str:
    """Commit, command, machine, corpus, sizes and protocols of the run the report comes from."""
    profile = record.get("profile", {})
    start, end = record.get("machine_at_start", {}), record.get("machine_at_end", {})
    lines = ["## Setup", "",
             f"- Command: `{record.get('command', 'bench/study.py')}` (profile `{profile.get('name')}`), commit "
             f"`{start.get('commit')}`{' (with uncommitted changes)' if start.get('dirty') else ''}; wall time of "
             f"this invocation {record.get('seconds', 0) / 60:.1f} min.",
             f"- Machine: {start.get('cpu')}, {start.get('cores')} cores, {start.get('platform')}; Python "
             f"{start.get('python')}, torch {start.get('torch')}; load average at start {start.get('load_average')}, "
             f"at end {end.get('load_average')} (other work on the machine slows the wall-time protocol).",
             f"- CPU time of the configurations (every rank's process time, summed): "
             f"{res.cpu_seconds() / 60:.1f} core-minutes; on an otherwise idle machine the study's wall time is "
             f"about that over the number of cores, plus about 10 s per launch.",
             f"- Seeds: {record.get('seeds')}; every table gives mean ± sample std over them and the paired "
             "difference to DDP (per seed, the run minus DDP of that seed)."]
    for task, sizes in profile.get("tasks", {}).items():
        if task not in res.tasks():
            continue
        if task == "pysrc":
            from subnet_ext.data.pysrc import load_pysrc

            d = load_pysrc().describe()
            corpus = (f"Python {d['python']}'s standard library, {d['files']['train']} training / {d['files']['val']} "
                      f"validation files (split by file), {d['characters']['train']:,} / {d['characters']['val']:,} "
                      f"characters, vocabulary {d['vocab_size']} (bytes 0-127), {d['skipped_non_ascii_files']} "
                      f"non-ASCII files skipped, SHA-256 {d['sha256'][:16]}…; held out: {sizes['eval_sequences']} "
                      f"windows of {sizes['seq_len']} characters evenly spaced over the validation files")
            from subnet_ext.models.gpt import GPT_PRESETS

            cfg = GPT_PRESETS[sizes["preset"]]
            model = (f"GPT `{sizes['preset']}` preset (subnet_ext/models/gpt.py: {cfg.n_layer} pre-LN blocks x "
                     f"{cfg.n_embd}, {cfg.n_head} heads, context {cfg.block_size}, tied embedding, "
                     f"{cfg.num_parameters() / 1e6:.2f} M parameters)")
        else:
            corpus = "scikit-learn's bundled digits (1,437 training / 360 test images, stratified split)"
            from subnet_ext.models import build_model

            mlp = build_model("mlp", in_features=64, num_classes=10)
            model = (f"residual MLP (width {mlp.stem.out_features}, {len(mlp.blocks)} pre-LN blocks with hidden "
                     f"width {mlp.blocks[0].fc1.out_features}, {sum(p.numel() for p in mlp.parameters()) / 1e6:.2f} M "
                     "parameters)")
        chars = f" x {sizes['seq_len']} characters" if task == "pysrc" else ""
        lines.append(f"- **{task}**: {model}; {corpus}. Batch {sizes['batch_size']} per rank{chars}, {sizes['steps']} steps, "
                     f"AdamW lr {sizes['lr']} (linear warmup {sizes['warmup_steps']} steps, then constant), weight "
                     f"decay {sizes['weight_decay']}; the full model evaluated every {sizes['eval_every']} steps (every "
                     f"{2 * sizes['eval_every']} past {sizes['steps']}), every model a user could keep at each "
                     "protocol's mark.")
    lines += ["- Protocols (bench/study_runs.py): the learning rate is constant after warmup, so a run's loss at step "
              "s is what a run of s steps reaches. Every run continues until it has taken the steps, spent the FLOPs "
              "and the training seconds of the DDP run of its seed and world size. *Equal iterations*: the loss at "
              "the last of the steps (the same tokens); *FLOP-matched*: at the first step where its FLOPs reach "
              "DDP's; *equal wall time*: at the first check (every "
              f"{profile.get('time_check_every')} steps) where its training seconds reach DDP's. A final phase "
              f"runs the last {profile.get('phase_fraction', 0):.0%} of the steps from the forward run's state.",
              ""]
    return "\n".join(lines)


def write_report(out: str, doc: str, record_path: str, main_only: bool = False) -> list[str]:
    """Write `doc` and its plots (in a folder named after it) from <out>/results; returns the paths."""
    from study_plots import plot_curves, plot_memory_vs_loss
    from study_verdict import summary_section, verdict_section

    res = Results(out)
    record = {}
    if os.path.exists(record_path):
        with open(record_path) as f:
            record = json.load(f)
    folder = os.path.splitext(doc)[0]
    os.makedirs(folder, exist_ok=True)
    written = [doc]
    title = os.path.basename(folder)
    parts = [f"# The study: when SDP beats DDP, FSDP2, activation checkpointing and stochastic depth ({title})",
             "", "Generated by `bench/study.py` from its results; every number below is measured in the run this "
             "file records. Loss: validation cross-entropy (nats per character on pysrc, per sample on digits) of "
             "the full model unless a column says otherwise; Δ: paired difference to DDP (negative is better).", "",
             summary_section(res), setup_section(res, record), verdict_section(res), ""]
    for task in res.tasks():
        parts.append(f"## {task}: {TASK_TITLES.get(task, task)}")
        for k in res.worlds(task):
            parts += [f"### {task}, K = {k} ranks", "", "Quality (full model) at each protocol:", "",
                      quality_table(res, task, k), ""]
            if any(n.startswith("sdp-") for n in res.names(task, k)):
                parts += ["Which model to keep (SDP runs, equal iterations; loss and Δ vs DDP):", "",
                          keep_table(res, task, k), ""]
            if res.get(task, k, res.seeds(task, k, "ddp")[0], "ddp")["curve"][-1].get("accuracy", {}).get("full") \
                    is not None and task == "digits":
                parts += ["Accuracy at equal iterations:", "", accuracy_table(res, task, k), ""]
            parts += ["Costs per rank (seed 0):", "", cost_table(res, task, k), ""]
            for path in plot_curves(res, task, k, folder) + plot_memory_vs_loss(res, task, k, folder):
                written.append(path)
                parts.append(f"![{os.path.basename(path)}]({os.path.relpath(path, os.path.dirname(doc) or '.')})")
            parts.append("")
    with open(doc, "w") as f:
        f.write("\n".join(parts) + "\n")
    return written
