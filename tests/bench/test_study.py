"""The study (python -m bench.study) end to end at its quick size, and its arithmetic.

One run of `python -m bench.study --quick` (Tiny Shakespeare, its 8-block model and the bf16 memory
measurement; 2 seeds; K = 4) is checked against what this file computes itself: model state from the
models' parameter counts, FSDP2's shards from torch.chunk sizes, FLOPs from models of the same shapes
(a block-level subnetwork computes what the dense model of its blocks computes, a neuron-level one what
the narrower dense model does), where every protocol's mark and cooldown fall, that the derived runs
(FSDP2, checkpointing) train their base run's model, that every label agrees with its interval, and
that summary.json says what the result files say. A cooldown branch restored from a snapshot is checked
against a run that decayed from there directly, nanoGPT's schedule against its own formula, and the
README's and the results page's generated blocks against the summary they name.
"""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

from bench.study.runs import (MAIN_TASK, MEMORY_TASK, PROFILES, all_configs, anchor_jobs, batch_size_of, cooldown_steps,
                              data_path, result_path)
from shakespeare_file import needs_tiny_shakespeare

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILE = PROFILES["quick"]
TASKS = ("shakespeare", "shakespeare-deep")
SEEDS = list(range(PROFILE["seeds"]))
pytestmark = needs_tiny_shakespeare


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from bench.study.results import Results

    out = tmp_path_factory.mktemp("study")
    doc = out / "doc" / "study.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "bench.study", "--quick", "--out", str(out), "--doc", str(doc),
                           "--data", data_path()], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return str(out), str(doc), Results(str(out))


def _load(out, task, seed, name, k=4):
    with open(result_path(out, task, k, seed, name)) as f:
        return json.load(f)


def _configs(task):
    return all_configs(task, SEEDS, PROFILE["tasks"][task]["runs"])


def _model(preset):
    from subnet_ext.models import build_model

    return build_model("gpt", preset=preset)


def test_every_configuration_ran_and_the_report_has_every_part(study):
    out, doc, res = study
    for task in TASKS + (MEMORY_TASK,):
        for cfg in all_configs(task, SEEDS if task != MEMORY_TASK else [0], PROFILE["tasks"][task]["runs"]):
            assert os.path.exists(result_path(out, task, 4, cfg["seed"], cfg["name"])), cfg
    for k, jobs in anchor_jobs(MAIN_TASK, SEEDS).items():
        for job in jobs:
            assert _load(out, MAIN_TASK, job["config"]["seed"], "recipe", k)["marks"]["tokens"]["step"] == \
                PROFILE["tasks"][MAIN_TASK]["steps"]
    text = open(doc).read()
    for part in ("## Should I use SDP?", "## Setup", "## The anchor: nanoGPT's published recipe", "## Verdict",
                 "Families of comparisons", "### Left for judgement", "Quality (full model)", "Which model to keep",
                 "Cost at inference", "Which blocks each rank trains", "Costs per rank",
                 f"## Memory a user would recognise ({MEMORY_TASK})", *(f"## {t}:" for t in TASKS)):
        assert part in text, part
    folder = os.path.join(os.path.dirname(doc), "study")
    for task in TASKS:
        for name in res.names(task, 4):
            assert f"| {name} |" in text, (task, name)
        for plot in (f"{task}-K4-curves.png", f"{task}-K4-memory.png"):
            assert open(os.path.join(folder, plot), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
            assert f"(study/{plot})" in text
    losses = [_load(out, MAIN_TASK, s, "ddp")["marks"]["tokens"]["loss"]["full"] for s in SEEDS]
    assert f"| ddp | {statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f} |" in text
    for name in res.names(MEMORY_TASK, 4):
        assert f"| {name} |" in text.split("## Memory a user would recognise")[1], name


def test_derived_runs_train_their_base_runs_model(study):
    """FSDP2 and checkpointing change where tensors live, not the updates: the first steps' training losses
    of each derived run (its own steps) equal its base run's, rank by rank."""
    out, _, _ = study
    derived = [c for c in _configs(MAIN_TASK) if c.get("derived_from")]
    assert {c["name"] for c in derived} >= {"fsdp", "ddp-ac", "sdp-block-forward-ac-c0.5"}
    for cfg in derived:
        mine = _load(out, MAIN_TASK, cfg["seed"], cfg["name"])["per_rank"]
        base = _load(out, MAIN_TASK, cfg["seed"], cfg["derived_from"])["per_rank"]
        for a, b in zip(mine, base):
            common = sorted(set(a["train_losses"]) & set(b["train_losses"]), key=int)
            assert len(common) >= 3, (cfg["name"], common)  # at least two updates compared
            for step in common:
                assert a["train_losses"][step] == pytest.approx(b["train_losses"][step], abs=1e-4), \
                    (cfg["name"], step)


def test_model_state_bytes_are_the_parameter_counts(study):
    out, _, _ = study
    model = _model("shakespeare")
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for rank in _load(out, MAIN_TASK, 0, "ddp")["per_rank"]:  # fp32 parameters, gradients, AdamW's moments, steps
        assert rank["memory"]["parameters"] == rank["memory"]["gradients"] == 4 * n
        assert rank["memory"]["optimizer_state"] == 8 * n + 4 * len(params)
        meter = rank["meter"]
        assert meter["model_state"] + meter["activations"] + meter["transient"] == meter["total"]
        assert meter["model_state"] >= 12 * n  # parameters and both moments are alive at any moment of a step
    for r, rank in enumerate(_load(out, MAIN_TASK, 0, "fsdp")["per_rank"]):  # dim-0 shards as torch.chunk makes
        shard = sum(c[r].numel() if r < len(c := torch.chunk(p.detach(), 4)) else 0 for p in params)
        assert rank["memory"]["parameters"] == 4 * shard, r
    for name, preset in (("sdp-block-forward-c0.5", "shakespeare-half-depth"),
                         ("sdp-neuron-forward-c0.5", "shakespeare-half-width"),
                         ("sdp-block-forward-c0.25", "shakespeare-quarter-depth"),
                         ("sdp-neuron-forward-c0.25", "shakespeare-quarter-width")):
        held = sum(p.numel() for p in _model(preset).parameters())  # the subnetwork is that dense model's size
        for rank in _load(out, MAIN_TASK, 0, name)["per_rank"]:
            assert rank["memory"]["parameters"] == 4 * held, (name, rank["rank"])


def test_a_subnetwork_computes_what_the_dense_model_of_its_size_computes(study):
    """FLOPs per step: a block-level subnetwork at C = 0.5 runs two of the four blocks, as the 2-block dense
    model does; a neuron-level one runs half of every block's heads and neurons, as the narrower dense model
    does; DDP's halved batch (3 sequences per rank rounded to 2) costs 2/3 of the FLOPs; the backward regime's full forward costs more than the forward's."""
    out, _, _ = study
    configs = {c["name"]: c for c in _configs(MAIN_TASK) if c["seed"] == 0}
    flops = {name: _load(out, MAIN_TASK, 0, name)["step_flops"] for name in configs}
    assert flops["sdp-block-forward-c0.5"] == flops["dense-half-depth"]
    assert flops["sdp-neuron-forward-c0.5"] == flops["dense-half-width"]
    assert flops["sdp-block-forward-c0.25"] == flops["dense-quarter-depth"]
    sizes = PROFILE["tasks"][MAIN_TASK]
    batches = [batch_size_of(configs[name], sizes) for name in ("ddp-halfbatch", "ddp")]
    assert batches == [2, 3]  # the recipe's 3 sequences per rank, halved and rounded
    assert flops["ddp-halfbatch"] * batches[1] == flops["ddp"] * batches[0] and flops["fsdp"] == flops["ddp"]
    assert flops["sdp-block-forward-c0.5"] < flops["sdp-block-backward-c0.5"] < flops["ddp"]


def test_marks_and_cooldowns_fall_where_the_budgets_are_reached(study):
    out, _, _ = study
    for task in TASKS:
        for seed in SEEDS:
            base = _load(out, task, seed, "ddp")["marks"]["tokens"]
            for cfg in [c for c in _configs(task) if c["seed"] == seed]:
                r = _load(out, task, seed, cfg["name"])
                at = r["marks"]
                assert at["tokens"]["tokens"] >= base["tokens"] > at["tokens"]["tokens"] - at["tokens"]["tokens"] \
                    / at["tokens"]["step"], cfg["name"]  # the first step with DDP's tokens
                assert at["flops"]["flops"] >= base["flops"] * (1 - 1e-12)
                if not cfg.get("stochastic_depth"):  # the first step that reaches DDP's FLOPs
                    assert (at["flops"]["step"] - 1) * r["step_flops"] < base["flops"] <= \
                        at["flops"]["step"] * r["step_flops"] * (1 + 1e-12), cfg["name"]
                for point in at.values():
                    start, end = point["cooldown"]
                    assert end == point["step"] and start == end - cooldown_steps(end, PROFILE["cooldown"])


def test_forward_regime_subnetworks_are_what_each_rank_trained(study):
    out, _, _ = study
    for name in ("sdp-block-forward-c0.5", "sdp-neuron-forward-c0.5"):
        checked = [p for p in _load(out, MAIN_TASK, 0, name)["marks"].values() if "subnetwork_check" in p]
        assert checked and all(p["subnetwork_check"] < 1e-5 for p in checked), name


def test_the_summary_says_what_the_result_files_say(study):
    out, doc, res = study
    with open(os.path.join(os.path.dirname(doc), "study", "summary.json")) as f:
        summary = json.load(f)
    t = summary["tasks"][MAIN_TASK]
    ddp = [_load(out, MAIN_TASK, s, "ddp")["marks"]["tokens"]["loss"]["full"] for s in SEEDS]
    assert t["ddp"]["protocols"]["tokens"]["loss"] == pytest.approx(statistics.fmean(ddp))
    assert t["per_seed"]["K4/ddp"]["tokens"]["full"] == {str(s): v for s, v in zip(SEEDS, ddp)}
    peak = lambda name: max(x["meter"]["total"] for s in SEEDS for x in _load(out, MAIN_TASK, s, name)["per_rank"])  # noqa: E731
    for name in ("ddp-ac", "sdp-block-forward-c0.5", "dense-half-depth"):
        assert t["runs"][name]["memory"] == pytest.approx(peak(name) / peak("ddp"))
    seen = set()
    for c in t["comparisons"]:  # each comparison once, in one family, its label read off its interval
        key = (c["a"], c["a_model"], c["b"], c["b_model"], c["protocol"])
        assert key not in seen, key
        seen.add(key)
        if c["lo"] is not None:
            assert (c["label"] == "better") == (c["hi"] < 0) and (c["label"] == "worse") == (c["lo"] > 0), c
            assert c["label"] != "no worse" or c["hi"] < t["margin"], c
        if (c["a_model"], c["b"], c["b_model"]) == ("full", "ddp", "full"):
            diffs = [_load(out, MAIN_TASK, s, c["a"])["marks"][c["protocol"]]["loss"]["full"] - ddp[s] for s in SEEDS]
            assert c["mean"] == pytest.approx(statistics.fmean(diffs)), c
    families = {f["name"]: f for f in t["families"]}
    assert set(families) <= {"decision", "vs ddp", "vs smaller dense", "which model to keep"}
    assert all(f["m"] == sum(c["family"] == f["name"] for c in t["comparisons"] if c["n"] >= 2)
               for f in families.values())
    rows = t["decision"]
    assert [r["budget"] for r in rows] == sorted((r["budget"] for r in rows), reverse=True)
    for row in rows:  # SDP is used only where its comparison says better or no worse at both protocols
        if row["sdp_setting"]:
            assert all(row[p]["delta"]["label"] in ("better", "no worse") for p in ("tokens", "flops")), row
    anchor = summary["anchor"]["runs"]
    assert len(anchor) == 3 and all(e["n"] == len(SEEDS) for e in anchor.values())


def _branch_worker(rank, world, data):
    """A cooldown branch restored from a snapshot equals a run that decayed from there directly."""
    from bench.study.evaluation import evaluate_method
    from bench.study.measure import register_masked_linear_flops
    from bench.study.training import Run
    from bench.study.worker import _reference, _task

    os.environ["SUBNET_EXT_TINY_SHAKESPEARE"] = data
    register_masked_linear_flops()
    profile = dict(PROFILE, name="quick")
    sizes = profile["tasks"][MAIN_TASK]
    task = _task(sizes, 0, sizes["batch_size"])
    reference = _reference(task, torch.device("cpu"))
    out = {}
    configs = [{"name": "ddp", "method": "ddp"}, {"name": "ddp-sd-c0.5", "method": "ddp", "stochastic_depth": 0.5},
               {"name": "sdp-block-forward-c0.5", "method": "sdp", "level": "block", "regime": "forward",
                "coverage": 0.5}]
    batches = list(task.eval_batches())[:2]
    for extra in configs:
        cfg = dict(extra, task=MAIN_TASK, K=world, seed=0, baseline="ddp")
        losses = []
        for restore in (True, False):
            run = Run(cfg, profile, torch.device("cpu"), task, reference)
            run.step_once()
            snap = run.snapshot()
            if restore:
                for _ in range(3):
                    run.step_once()
                run.restore(snap)
            run.cooldown = (1, 4)
            while run.step < 4:
                run.step_once()
            found = evaluate_method(cfg["method"], run.method, task, batches, torch.device("cpu"), run.stochastic,
                                    every_model=False)
            losses.append(found["loss"]["full"])
            run.close()
        out[cfg["name"]] = losses
    return out


def test_a_restored_cooldown_branch_is_a_direct_decay():
    from subnet_ext.testing import run_distributed

    for found in run_distributed(_branch_worker, 2, data_path(), timeout=600):
        for name, (restored, direct) in found.items():
            assert restored == pytest.approx(direct, abs=1e-6), name


def test_the_learning_rate_schedules_and_the_marks():
    from bench.study.runs import flops_mark, seconds_mark, tokens_mark
    from bench.study.training import lr_factor, recipe_lr_factor

    assert tokens_mark(1000, 100) == 10 and tokens_mark(1000, 300) == 4
    assert flops_mark(10.0, lambda s: 3.0, 100) == 4 and flops_mark(10.0, lambda s: 3.0, 3) is None
    assert flops_mark(6.0, lambda s: [1.0, 2.0, 3.0][s], 3) == 3  # stochastic depth: per-step FLOPs differ
    assert seconds_mark(10.0, 0.3, 100) == 34 and seconds_mark(10.0, 0.3, 20) is None
    assert [cooldown_steps(m, 0.2) for m in (1, 2, 10, 250)] == [1, 1, 2, 50]
    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 2, (6, 10)) for s in range(5, 11)] == [1.0, 1.0, 0.75, 0.5, 0.25, 1.0]

    def get_lr(it, learning_rate=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=2000):
        # nanoGPT's train.py, as written there
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return min_lr + coeff * (learning_rate - min_lr)

    for it in (0, 50, 99, 100, 101, 1000, 1999, 2000, 2001):
        assert 1e-3 * recipe_lr_factor(it, 100, 2000, 0.1) == pytest.approx(get_lr(it), rel=1e-12), it


def test_bad_arguments_and_a_missing_corpus_are_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.study", "--seeds", "0", "--report-only"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--seeds must be at least 1" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bench.study", "--quick", "--report-only", "--data",
                           str(tmp_path / "missing.txt"), "--out", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "missing.txt" in proc.stderr and "is not a file" in proc.stderr


# ------------------------------------------------------------------------------------- the committed docs
def _block_and_summary(path):
    from bench.study import decision

    with open(path) as f:
        text = f.read()
    block = decision.current_block(text)
    assert block is not None, f"{path} has no generated block"
    source = os.path.join(os.path.dirname(path), decision.block_source(block))
    with open(source) as f:
        return text, block, json.load(f)


@pytest.mark.parametrize("page", ["README.md", os.path.join("docs", "results.md")])
def test_generated_blocks_are_what_their_summary_gives(page):
    """Every figure in the README's and the results page's study blocks: rendered again from the summary
    file the block names, it must come out the same (so nothing there is typed by hand); the README's
    example uses the setting the evidence supports, or the one closest to it when it supports none."""
    from bench.study import decision

    path = os.path.join(REPO, page)
    text, block, summary = _block_and_summary(path)
    link = None
    for line in block.splitlines():
        if line.startswith("From [the study]("):
            link = line.split("](", 1)[1].split(")", 1)[0]
    assert block == decision.render_block(summary, link, decision.block_source(block),
                                          first_task_only=page == "README.md")
    if page == "README.md":
        task = next(iter(summary["tasks"].values()))
        chosen = task["recommended"] or task["closest"]
        example = decision.example_setting(text)
        assert (example["level"], example["regime"], example["coverage"]) == (chosen["level"], chosen["regime"],
                                                                              chosen["coverage"])
        assert example["cli"] == (chosen["level"], chosen["regime"], chosen["coverage"])


def _mean_at_equal_tokens(per_seed: dict, name: str):
    values = list(per_seed.get(f"K4/{name}", {}).get("tokens", {}).get("full", {}).values())
    return statistics.mean(values) if values else None


def test_best_schedules_are_the_sweeps_best():
    """BEST_SCHEDULES (what the full study trains) is what the committed sweep measured: for each level the
    schedule with the lowest mean full-model loss at equal tokens, where it beats the level's static run,
    recomputed here from the sweep's per-seed losses; the sweep measured every schedule it lists."""
    from bench.study.runs import BEST_SCHEDULES, SCHEDULES, best_schedules, schedule_name

    with open(os.path.join(REPO, "docs", "study-schedules", "summary.json")) as f:
        per_seed = json.load(f)["tasks"][MAIN_TASK]["per_seed"]
    expected = []
    for level in ("block", "neuron"):
        names = {schedule_name(*e): e for e in SCHEDULES if e[0] == level}
        losses = {n: _mean_at_equal_tokens(per_seed, n) for n in names}
        assert all(v is not None for v in losses.values()), f"the sweep lacks a {level} schedule: {losses}"
        best = min(losses, key=losses.get)
        if losses[best] < _mean_at_equal_tokens(per_seed, f"sdp-{level}-forward-c0.5"):
            expected.append(names[best])
    assert BEST_SCHEDULES == tuple(expected) == best_schedules(per_seed)


def test_best_schedules_reads_the_lowest_mean_that_beats_static():
    from bench.study.runs import SCHEDULES, best_schedules, schedule_name

    def entry(loss_by_seed):
        return {"tokens": {"full": {str(i): v for i, v in enumerate(loss_by_seed)}}}

    per_seed = {"K4/sdp-block-forward-c0.5": entry([2.0, 2.2]), "K4/sdp-neuron-forward-c0.5": entry([1.0])}
    for i, e in enumerate(SCHEDULES):
        per_seed[f"K4/{schedule_name(*e)}"] = entry([2.5 - 0.01 * i, 2.5])  # neuron level: all worse than static
    target = next(e for e in SCHEDULES if e[0] == "block" and e[1] == "redraw" and e[2] == 50)
    per_seed[f"K4/{schedule_name(*target)}"] = entry([1.9, 2.0])
    assert best_schedules(per_seed) == (target,)
    del per_seed[f"K4/{schedule_name(*target)}"]
    assert best_schedules(per_seed) == ()  # a level with a schedule missing gives nothing


def test_the_distance_to_ddp_is_read_off_the_per_seed_losses():
    """Each level's best SDP run against DDP, from per-seed losses written here: the gap is the difference of
    the means, and the 'where the loss is lost' clause only when every part beats the whole."""
    from bench.study.report import schedules_distance

    def entry(full, subs=None, ens=None):
        out = {"full": {str(i): v for i, v in enumerate(full)}}
        if subs is not None:
            out["subnetworks"] = {str(i): v for i, v in enumerate(subs)}
            out["ensemble"] = {str(i): v for i, v in enumerate(ens)}
        return {"tokens": out}

    per_seed = {"K4/ddp": entry([1.8, 2.0]),
                "K4/sdp-block-forward-c0.5": entry([3.0, 3.2], [[1.9, 2.1], [2.0, 2.0]], [1.95, 1.95]),
                "K4/sdp-neuron-forward-c0.5": entry([1.92, 1.96], [[2.0, 2.2], [2.1, 2.1]], [1.9, 1.9])}
    block, neuron = schedules_distance(per_seed, 0.05)
    assert "`sdp-block-forward-c0.5`, is +1.200 from DDP" in block and "not within the 0.05 goal" in block
    assert "subnetworks reach 2.000 on average and their ensemble 1.950: the loss is lost" in block
    assert "+0.040 from DDP" in neuron and ", within the 0.05 goal" in neuron and "the loss is lost" not in neuron
