"""The study: which method to train with, DDP, FSDP2, activation checkpointing, stochastic depth,
a smaller dense model or SDP, on nanoGPT's Tiny Shakespeare benchmark at its published CPU recipe.

    make study                               # the whole study on this machine's CPU (hours: docs/status.md)
    .venv/bin/python -m bench.study --quick  # the same pipeline at a few steps (<= 3 min; CI runs it)
    .venv/bin/python -m bench.study --device cuda   # one GPU per rank (4 GPUs)

What runs and how the protocols are read: runs.py. Each world size is launched once (worker.py:
K = 4 ranks, and one process for the anchor); results go to
<out>/results/<task>/K<k>/seed*/<run>.json as each job finishes,
so an interrupted study continues where it stopped (results of another profile are redone).
The report (report.py) is written from those files: <doc>, and beside it, in a folder
named after it, its plots and summary.json; the full CPU study (or --update-docs) also rewrites
the generated blocks of README.md and docs/results.md from that summary (decision.py).
`--report-only` rewrites the report from the results.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from .runs import MAIN_K, PROFILES, TASKS, anchor_jobs, data_path, jobs, result_path


def build_parser() -> argparse.ArgumentParser:
    """The study's options: size (--quick, --profile), device, seeds, output folder and report."""
    p = argparse.ArgumentParser(prog="python -m bench.study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the reduced study (profile 'quick', <= 3 min on 2 cores)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=None,
                   help="sizes by name (default: full on cpu, cuda on cuda, quick with --quick)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="Tiny Shakespeare's input.txt (default: $SUBNET_EXT_TINY_SHAKESPEARE, else "
                        "../shared/data/tinyshakespeare.txt beside the repository)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the profile's)")
    p.add_argument("--only", type=lambda v: v.split(","), default=None, metavar="RUN,RUN",
                   help="run only these configurations (and ddp, which the others are read against), e.g. to "
                        "redo a few; the report covers every result present")
    p.add_argument("--tasks", type=lambda v: v.split(","), default=None,
                   help=f"comma-separated subset of {','.join(TASKS)} (default: every task of the profile)")
    p.add_argument("--out", default=None, help="results folder (default runs/study-<profile>)")
    p.add_argument("--doc", default=None,
                   help="the report's path (default docs/study-cpu.md for the full CPU study, docs/study-cuda.md "
                        "for cuda, else <out>/study.md); plots go to a folder of the same name")
    p.add_argument("--report-only", action="store_true", help="write the report from existing results, train nothing")
    p.add_argument("--update-docs", action="store_true",
                   help="also rewrite the generated blocks of README.md and docs/results.md (and the README example's "
                        "SDP setting) from this report; the default for the full CPU study writing docs/study-cpu.md")
    p.add_argument("--fresh", action="store_true", help="discard the results of earlier invocations")
    return p


def _profile_name(opts) -> str:
    if opts.profile:
        return opts.profile
    if opts.quick:
        return "quick"
    return "cuda" if opts.device == "cuda" else "full"


def _default_doc(name: str, device: str, out: str) -> str:
    if name == "full" and device == "cpu":
        return os.path.join("docs", "study-cpu.md")
    if name == "quick" and device == "cpu":
        return os.path.join("docs", "study-cpu-quick.md")
    if name == "cuda":
        return os.path.join("docs", "study-cuda.md")
    if name == "schedules" and device == "cpu":
        return os.path.join("docs", "study-schedules.md")
    return os.path.join(out, "study.md")


def _doc_blocks(doc: str, requested: bool) -> dict:
    """{Markdown file: how it links to the report} whose generated blocks this report rewrites: README.md
    and docs/results.md, for the full CPU study (docs/study-cpu.md) or when requested."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/study/ -> repo
    is_main = os.path.abspath(doc) == os.path.join(root, "docs", "study-cpu.md")
    if not (requested or is_main):
        return {}
    readme, results = os.path.join(root, "README.md"), os.path.join(root, "docs", "results.md")
    # The report is shown in the documentation through results/study-cpu.md (the README, which the
    # documentation includes too, links the results page's study section); another report is no page of
    # the documentation, so the blocks name it without a link.
    return {readme: "docs/results.md#the-study" if is_main else None,
            results: "results/study-cpu.md" if is_main else None}


def _done(out: str, cfg: dict, profile: dict) -> bool:
    path = result_path(out, cfg["task"], cfg["K"], cfg["seed"], cfg["name"])
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f).get("profile") == profile


def task_seeds(profile: dict, task: str, seeds: int | None = None) -> list[int]:
    """Seeds 0..n-1 of a task: `seeds` when given, else the task's own count, else the profile's."""
    return list(range(seeds or profile["tasks"][task].get("seeds") or profile["seeds"]))


def planned_jobs(profile: dict, tasks, seeds: int | None = None) -> dict[int, list[dict]]:
    """{world size: jobs} of the tasks (runs.jobs at MAIN_K; the anchor's at 1 and MAIN_K)."""
    out = {}
    for task in tasks:
        sizes, chosen = profile["tasks"][task], task_seeds(profile, task, seeds)
        if sizes.get("anchor"):
            for k, js in anchor_jobs(task, chosen).items():
                out.setdefault(k, []).extend(js)
        out.setdefault(MAIN_K, []).extend(jobs(task, chosen, MAIN_K, sizes["runs"]))
    return dict(sorted(out.items()))


def _pending(out: str, js: list[dict], profile: dict, only=None) -> list[dict]:
    """The jobs with a missing (or other-profile) result; a job's derived runs rerun with it.
    only: configuration names to keep (ddp always kept: the others need its tokens and FLOPs)."""
    return [j for j in js if (only is None or j["config"]["name"] in {"ddp", *only})
            and not all(_done(out, c, profile) for c in [j["config"], *j["readers"]])]


def machine() -> dict:
    """The setup a report states: commit, Python, torch, CPU, cores, load."""
    import torch

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    cpu = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu,
            "cores": os.cpu_count(), "platform": platform.platform(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def run_study(opts) -> dict:
    """Train every pending configuration (one launch per world size); returns the run's record."""
    from .worker import run_group
    from subnet_ext.jobs.launch import choose_backend, spawn_local

    name = _profile_name(opts)
    profile = dict(PROFILES[name], name=name)
    out = opts.out or os.path.join("runs", f"study-{name}")
    record = {"profile": profile, "seeds": {t: task_seeds(profile, t, opts.seeds) for t in opts.tasks}, "out": out,
              "started": time.time(), "machine_at_start": machine(), "launches": []}
    for k, planned in planned_jobs(profile, opts.tasks, opts.seeds).items():
        todo = _pending(out, planned, profile, opts.only)
        if not todo:
            continue
        choose_backend("auto", opts.device, k)  # refuses --device cuda with fewer GPUs than ranks, clearly
        t0 = time.time()
        print(f"[study] K={k}: {len(todo)} job(s) ...", flush=True)
        spawn_local(run_group, {"device": opts.device, "profile": profile, "out": out, "jobs": todo}, k)
        record["launches"].append({"K": k, "jobs": len(todo), "seconds": time.time() - t0})
    record["seconds"] = time.time() - record["started"]
    record["machine_at_end"] = machine()
    return record


def main(argv=None) -> int:
    """Run (or with --report-only, only report) the study; returns the exit code."""
    opts = build_parser().parse_args(argv)
    if opts.seeds is not None and opts.seeds < 1:
        print(f"python -m bench.study: --seeds must be at least 1, got {opts.seeds}", file=sys.stderr)
        return 2
    opts.tasks = opts.tasks or list(PROFILES[_profile_name(opts)]["tasks"])
    unknown = sorted(set(opts.tasks) - set(PROFILES[_profile_name(opts)]["tasks"]))
    if unknown:
        print(f"python -m bench.study: unknown task(s) {unknown}; profile {_profile_name(opts)}'s tasks are "
              f"{', '.join(PROFILES[_profile_name(opts)]['tasks'])}", file=sys.stderr)
        return 2
    from subnet_ext.data.shakespeare import ENVIRONMENT_VARIABLE, load_tiny_shakespeare

    os.environ[ENVIRONMENT_VARIABLE] = data_path(opts.data)  # the ranks read it from there
    try:
        load_tiny_shakespeare(os.environ[ENVIRONMENT_VARIABLE])  # a missing or changed file stops here, clearly
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m bench.study: {e}", file=sys.stderr)
        return 2
    name = _profile_name(opts)
    out = opts.out or os.path.join("runs", f"study-{name}")
    if opts.fresh and os.path.isdir(os.path.join(out, "results")):
        import shutil

        shutil.rmtree(os.path.join(out, "results"))
    os.makedirs(out, exist_ok=True)
    record_path = os.path.join(out, "study-run.json")
    if not opts.report_only:
        record = run_study(opts)
        record["command"] = "python -m bench.study " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(record_path, "w") as f:
            json.dump(record, f, indent=1)
    from .report import write_report

    doc = opts.doc or _default_doc(name, opts.device, out)
    written = write_report(out, doc, record_path, _doc_blocks(doc, opts.update_docs))
    print(f"[study] wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
