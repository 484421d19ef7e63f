"""The study (bench/study.py) end to end at its tiny size, and its arithmetic.

One run of `bench/study.py --profile tiny` (both tasks, 2 seeds, K = 4 and 2) is checked
against things this file computes itself: memory from the models' parameter counts, FLOPs
from the layers' shapes (digits' residual MLP, whose products are all Linear layers),
stochastic depth's per-rank FLOPs from its draws, FSDP2's shards from torch.chunk sizes,
and the identity of DDP, FSDP2 and checkpointed DDP's updates. The report's aggregation
(mean ± std, paired differences, Pareto front) is checked on made-up results.
"""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

from study_plots import pareto_front  # noqa: E402
from study_results import Results, paired, significant  # noqa: E402
from study_runs import PROFILES, jobs, result_path  # noqa: E402

TASKS = ("pysrc", "digits")
WORLDS = (4,)  # the K = 2 launch runs the same code (one more launch would double the test's cost)
PROFILE = PROFILES["tiny"]
SEEDS = list(range(PROFILE["seeds"]))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    doc = out / "doc" / "study.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "study.py"), "--profile", "tiny",
                           "--out", str(out), "--doc", str(doc), "--tasks", ",".join(TASKS), "--main-only"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return str(out), str(doc), Results(str(out))


def _load(out, task, k, seed, name):
    with open(result_path(out, task, k, seed, name)) as f:
        return json.load(f)


def _model(task):
    from subnet_ext.cli.tasks import build_task

    sizes = PROFILE["tasks"][task]
    return build_task(sizes["data"], sizes["model"], sizes["preset"], sizes["batch_size"], sizes["seq_len"],
                      0).make_model()


def test_every_configuration_ran_and_the_report_has_every_part(study):
    out, doc, res = study
    for task in TASKS:
        for k in WORLDS:
            for job in jobs(task, SEEDS, k):
                for cfg in [job["config"], *job["phases"]]:
                    assert os.path.exists(result_path(out, task, k, cfg["seed"], cfg["name"])), cfg
    text = open(doc).read()
    for part in ("## Setup", "## Verdict", "### Left for judgement", "Quality (full model)", "Which model to keep",
                 "Costs per rank", "Accuracy at equal iterations", *(f"## {t}" for t in TASKS)):
        assert part in text, part
    for task in TASKS:
        for k in WORLDS:
            for name in res.names(task, k):
                assert f"| {name} |" in text, (task, k, name)
            for plot in (f"{task}-K{k}-curves.png", f"{task}-K{k}-memory.png"):
                path = os.path.join(os.path.dirname(doc), "study", plot)
                assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
                assert f"(study/{plot})" in text
    ddp = res.summary(TASKS[0], 4, "ddp", "tokens")  # the table's number is the mean of the result files
    losses = [_load(out, TASKS[0], 4, s, "ddp")["curve"][-1]["loss"]["full"] for s in SEEDS]
    assert f"| ddp | {statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f} |" in text
    assert ddp["n"] == len(SEEDS)


def test_fsdp_and_checkpointing_train_the_same_model_as_ddp(study):
    out, _, res = study
    for task in TASKS:
        for seed in SEEDS:
            base = res.value(task, 4, seed, "ddp", "tokens")
            for name in ("fsdp", "ddp-ac"):
                assert abs(res.value(task, 4, seed, name, "tokens") - base) < 1e-4, (task, seed, name)


def test_model_state_bytes_are_the_parameter_counts(study):
    out, _, _ = study
    for task in TASKS:
        model = _model(task)
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        ddp = _load(out, task, 4, 0, "ddp")["per_rank"]
        for rank in ddp:  # fp32 parameters and gradients, AdamW's two moments and a 0-d fp32 step each
            assert rank["memory"]["parameters"] == rank["memory"]["gradients"] == 4 * n
            assert rank["memory"]["optimizer_state"] == 8 * n + 4 * len(params)
        fsdp = _load(out, task, 4, 0, "fsdp")["per_rank"]
        for r, rank in enumerate(fsdp):  # each parameter split along dim 0 as torch.chunk does
            shard = sum(c[r].numel() if r < len(c := torch.chunk(p.detach(), 4)) else 0 for p in params)
            assert rank["memory"]["parameters"] == 4 * shard, (task, r)
        blocks = [m for name, m in model.named_modules() if name.count(".") == (2 if task == "pysrc" else 1)
                  and name.split(".")[-1].isdigit()]
        per_block = sum(p.numel() for p in blocks[0].parameters())
        assert len(blocks) == 4 and all(sum(p.numel() for p in b.parameters()) == per_block for b in blocks)
        sdp = _load(out, task, 4, 0, "sdp-block-forward-c0.5")["per_rank"]
        for rank in sdp:  # every rank holds the shared parameters and two of the four blocks
            assert rank["memory"]["parameters"] == 4 * (n - 4 * per_block + 2 * per_block)


def _mlp_flops(batch, blocks_forward, blocks_weight_grad, hidden=512, width=128, inputs=64, classes=10):
    """A training step of the residual MLP: Linear forward 2*B*in*out, grad input the same (not for the
    stem, whose input needs none), grad weight the same (for the blocks whose weights are trained)."""
    linear = lambda i, o: 2 * batch * i * o  # noqa: E731
    block = linear(width, hidden) + linear(hidden, width)
    forward = linear(inputs, width) + blocks_forward * block + linear(width, classes)
    grad_input = forward - linear(inputs, width)
    grad_weight = linear(inputs, width) + blocks_weight_grad * block + linear(width, classes)
    return forward + grad_input + grad_weight


def test_flops_are_the_layers_products(study):
    out, _, _ = study
    from subnet_ext.cli.stochastic_depth import StochasticDepth

    b = PROFILE["tasks"]["digits"]["batch_size"]
    expected = {"ddp": _mlp_flops(b, 4, 4), "sdp-block-forward-c0.5": _mlp_flops(b, 2, 2), "sdp-block-forward-c0.25": _mlp_flops(b, 1, 1),
                "sdp-block-backward-c0.5": _mlp_flops(b, 4, 2), "sdp-block-backward-c0.25": _mlp_flops(b, 4, 1),
                # neuron level: half (a quarter) of each block's hidden units, in the forward regime compact, in
                # the backward regime only their weight gradients (the masked kernels, given formulas)
                "sdp-neuron-forward-c0.5": _mlp_flops(b, 2, 2), "sdp-neuron-forward-c0.25": _mlp_flops(b, 1, 1),
                "sdp-neuron-backward-c0.5": _mlp_flops(b, 4, 2), "sdp-neuron-backward-c0.25": _mlp_flops(b, 4, 1)}
    # Checkpointing recomputes each block's forward in backward up to the last tensor its backward needs
    # (non-reentrant checkpoints stop early): fc1 and the activation, not fc2, whose output nothing saves.
    expected["ddp-ac"] = _mlp_flops(b, 4, 4) + 4 * 2 * b * 128 * 512
    for name, flops in expected.items():
        for rank in _load(out, "digits", 4, 0, name)["per_rank"]:
            assert rank["counted_step_flops"] == flops, (name, rank["rank"])
    for c in (0.5, 0.25):
        result = _load(out, "digits", 4, 0, f"ddp-sd-c{c:g}")
        for rank in result["per_rank"]:
            kept = StochasticDepth(_model("digits"), 1 - c, 0, rank["rank"]).kept_blocks(0, rank["rank"])
            assert rank["counted_step_flops"] == _mlp_flops(b, sum(kept), sum(kept)), (c, rank["rank"])


def test_protocol_marks_fall_where_the_budgets_are_reached(study):
    out, _, res = study
    for task in TASKS:
        sizes = PROFILE["tasks"][task]
        for k in WORLDS:
            for seed in SEEDS:
                base = _load(out, task, k, seed, "ddp")
                budget = next(p for p in base["curve"] if "tokens" in p["marks"])
                for name in res.names(task, k):
                    r = _load(out, task, k, seed, name)
                    at = {m: p for p in r["curve"] for m in p["marks"]}
                    assert at["tokens"]["step"] == sizes["steps"]
                    assert at["tokens"]["tokens"] == sizes["steps"] * k * sizes["batch_size"] * sizes["seq_len"]
                    if name == "ddp" or "+" in name:
                        continue
                    assert at["flops"]["flops"] >= budget["flops"]
                    if "seconds" in at:
                        assert at["seconds"]["seconds"] >= budget["seconds"]
                    else:  # gave up at twice the steps the other marks needed
                        reached = max(at["tokens"]["step"], at["flops"]["step"])
                        assert at["seconds_not_reached"]["step"] == 2 * reached, (task, name)
                    if not r["config"].get("stochastic_depth"):  # the first step that reaches DDP's FLOPs
                        assert (at["flops"]["step"] - 1) * r["step_flops"] < budget["flops"] <= \
                            at["flops"]["step"] * r["step_flops"]


def test_forward_regime_subnetworks_are_what_each_rank_trained(study):
    out, _, _ = study
    for task in TASKS:
        for name in ("sdp-block-forward-c0.5", "sdp-neuron-forward-c0.25"):
            checked = [p for p in _load(out, task, 4, 0, name)["curve"] if "subnetwork_check" in p]
            assert checked and all(p["subnetwork_check"] < 1e-5 for p in checked), (task, name)


def _fake_result(out, task, k, seed, name, loss, flops=1.0):
    path = result_path(out, task, k, seed, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    point = {"step": 4, "tokens": 4, "flops": flops, "seconds": 1.0, "marks": ["tokens", "flops", "seconds", "end"],
             "loss": {"full": loss}}
    with open(path, "w") as f:
        json.dump({"config": {"task": task, "K": k, "seed": seed, "name": name, "baseline": "ddp"},
                   "curve": [point]}, f)


def test_means_paired_differences_and_the_pareto_front(tmp_path):
    ddp, sdp = [2.0, 2.2, 2.1], [2.1, 2.4, 2.2]
    for seed in range(3):
        _fake_result(str(tmp_path), "pysrc", 4, seed, "ddp", ddp[seed])
        _fake_result(str(tmp_path), "pysrc", 4, seed, "sdp-block-forward-c0.5", sdp[seed])
    res = Results(str(tmp_path))
    s = res.summary("pysrc", 4, "sdp-block-forward-c0.5", "tokens")
    diffs = [a - b for a, b in zip(sdp, ddp)]
    assert s["mean"] == pytest.approx(sum(sdp) / 3) and s["std"] == pytest.approx(statistics.stdev(sdp))
    assert s["delta"] == pytest.approx(sum(diffs) / 3) and s["delta_std"] == pytest.approx(statistics.stdev(diffs))
    m, sd, n = paired(res, "pysrc", 4, ("sdp-block-forward-c0.5", "full"), ("ddp", "full"))
    assert (m, n) == (pytest.approx(s["delta"]), 3)
    assert significant(m, sd, n) == (abs(m) > 4.302652729911275 * sd / math.sqrt(3))  # t(0.975, 2 dof)
    assert significant(1.0, 0.1, 3) and not significant(0.1, 0.1, 3)
    assert not significant(0.1, float("nan"), 1)
    points = [(1.0, 3.0, "a"), (2.0, 2.0, "b"), (2.5, 2.5, "c"), (3.0, 1.0, "d"), (3.0, 1.5, "e")]
    assert [p[2] for p in pareto_front(points)] == ["a", "b", "d"]


def test_bad_seed_count_is_refused():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "study.py"), "--seeds", "0", "--report-only"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--seeds must be at least 1" in proc.stderr
