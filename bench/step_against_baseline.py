"""Is the step no slower than at a baseline commit? The step benchmark (bench/e2e.py) on both trees.

    python bench/step_against_baseline.py --baseline c436767 --out bench/results/step-against-baseline-cpu.md

bench/e2e.py runs, as its own process, on the checked-out tree and on the baseline commit (extracted
with `git archive`, the built extension copied in: provenance.baseline_tree), in interleaved
invocations so that a drift of the machine's speed hits both alike. Each invocation measures DDP and
SDP (both levels, both regimes) on the same workers in interleaved rounds and reports each SDP
run's step time as a ratio to DDP's of the same round; this script compares those ratios (DDP's
code is torch's on both trees, so it is the yardstick): per SDP run, the median over invocations
of its ×DDP on each tree, and this tree's over the baseline's (below 1: faster).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E = ["--models", "small", "--worlds", "4", "--coverages", "0.5", "--methods", "ddp,sdp", "--skip-overlap"]


def ratios_to_ddp(tree: str, args: list[str], out: str) -> dict[str, float]:
    """{SDP run: its median step time over DDP's} from one bench/e2e.py invocation in `tree`."""
    env = dict(os.environ, PYTHONPATH=tree, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, os.path.join(tree, "bench", "e2e.py"), *args, "--out", out], cwd=tree,
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"bench/e2e.py in {tree} exited {done.returncode}:\n{done.stderr[-2000:]}")
    found = {}
    with open(out) as f:
        for line in f:
            cells = [c.strip() for c in line.split("|")[1:-1]]
            # main table rows: model | K | run | owners/unit | step ms | ×ddp, median [range] | ...
            if len(cells) >= 6 and cells[2].startswith("sdp") and cells[5][:1].isdigit():
                found[cells[2]] = float(cells[5].split()[0])
    if not found:
        raise RuntimeError(f"no SDP row in {out}")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the commit to compare with (e.g. the one before the change)")
    p.add_argument("--invocations", type=int, default=3, help="bench/e2e.py invocations per tree, interleaved")
    p.add_argument("--rounds", type=int, default=3, help="bench/e2e.py's interleaved rounds per invocation")
    p.add_argument("--sdp-variants", default=None, help="bench/e2e.py's --sdp-variants (default: its own, all four)")
    p.add_argument("--out", default=None, help="write the Markdown report here (default: print it)")
    opts = p.parse_args(argv)
    args = E2E + ["--rounds", str(opts.rounds)] + (["--sdp-variants", opts.sdp_variants] if opts.sdp_variants else [])
    started, load_before = time.time(), provenance.load()
    base = subprocess.run(["git", "rev-parse", "--short", opts.baseline], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    folder = tempfile.mkdtemp(prefix="step-ab-")
    found = {}
    try:
        trees = {f"baseline {base}": provenance.baseline_tree(opts.baseline, folder), "this tree": ROOT}
        for i in range(opts.invocations):
            for label, tree in trees.items():
                ratios = ratios_to_ddp(tree, args, os.path.join(folder, f"e2e-{i}.md"))
                for run, ratio in ratios.items():
                    found.setdefault(run, {}).setdefault(label, []).append(ratio)
                print(f"invocation {i + 1}, {label}: {ratios}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    command = "python bench/step_against_baseline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = provenance.header("The step against a baseline commit (CPU, gloo)", command.strip(), started,
                              load_before) + [
        f"Each cell: the median over {opts.invocations} interleaved invocations of `python bench/e2e.py "
        f"{' '.join(args)}` of the SDP run's step time as a multiple of DDP's in the "
        "same round (bench/e2e.py's ×ddp), [min-max] over invocations; last column: this tree's over the "
        "baseline's (below 1: faster).", "",
        f"| run | ×ddp, baseline {base} | ×ddp, this tree | this tree / baseline |", "|---|---:|---:|---:|"]
    for run, by_tree in found.items():
        cells = []
        for label in (f"baseline {base}", "this tree"):
            xs = by_tree.get(label, [])
            cells.append(f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]" if xs else "n/a")
        both = [statistics.median(by_tree[k]) for k in (f"baseline {base}", "this tree") if by_tree.get(k)]
        cells.append(f"{both[1] / both[0]:.3f}" if len(both) == 2 else "n/a")
        lines.append(f"| {run} | " + " | ".join(cells) + " |")
    provenance.emit(lines, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
