"""The study (bench/study.py) end to end at its tiny size, and its arithmetic.

One run of `bench/study.py --profile tiny` (both tasks, 2 seeds, K = 4) is checked against
things this file computes itself: model state from the models' parameter counts, FLOPs from
the layers' shapes (digits' residual MLP, whose products are all Linear layers), stochastic
depth's per-rank FLOPs from its draws, FSDP2's shards from torch.chunk sizes, where every
protocol's mark and cooldown fall, that the derived runs (FSDP2, checkpointing) train their
base run's model, and that summary.json says what the result files say. A cooldown branch
restored from a snapshot is checked against a run that decayed from there directly. The
README's and the results page's generated blocks are checked against the summary they name.
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

from study_runs import PROFILES, all_configs, cooldown_steps, result_path  # noqa: E402

TASKS = ("pysrc", "digits")
PROFILE = PROFILES["tiny"]
SEEDS = list(range(PROFILE["seeds"]))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from study_results import Results

    out = tmp_path_factory.mktemp("study")
    doc = out / "doc" / "study.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "study.py"), "--profile", "tiny",
                           "--out", str(out), "--doc", str(doc), "--tasks", ",".join(TASKS)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return str(out), str(doc), Results(str(out))


def _load(out, task, seed, name):
    with open(result_path(out, task, 4, seed, name)) as f:
        return json.load(f)


def _configs(task):
    return all_configs(task, SEEDS, PROFILE["tasks"][task]["runs"])


def _model(task):
    from subnet_ext.cli.tasks import build_task

    sizes = PROFILE["tasks"][task]
    return build_task(sizes["data"], sizes["model"], sizes["preset"], sizes["batch_size"], sizes["seq_len"],
                      0).make_model()


def test_every_configuration_ran_and_the_report_has_every_part(study):
    out, doc, res = study
    for task in TASKS:
        for cfg in _configs(task):
            assert os.path.exists(result_path(out, task, 4, cfg["seed"], cfg["name"])), cfg
    text = open(doc).read()
    for part in ("## Should I use SDP?", "## Setup", "## Verdict", "### Left for judgement", "Quality (full model)",
                 "Which model to keep", "Which blocks each rank trains", "Costs per rank", "Accuracy at equal tokens",
                 *(f"## {t}" for t in TASKS)):
        assert part in text, part
    folder = os.path.join(os.path.dirname(doc), "study")
    for task in TASKS:
        for name in res.names(task, 4):
            assert f"| {name} |" in text, (task, name)
        for plot in (f"{task}-K4-curves.png", f"{task}-K4-memory.png"):
            assert open(os.path.join(folder, plot), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
            assert f"(study/{plot})" in text
    losses = [_load(out, "pysrc", s, "ddp")["marks"]["tokens"]["loss"]["full"] for s in SEEDS]
    assert f"| ddp | {statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f} |" in text


def test_derived_runs_train_their_base_runs_model(study):
    """FSDP2 and checkpointing change where tensors live, not the updates: the first steps' training losses
    of each derived run (its own steps) equal its base run's, rank by rank."""
    out, _, _ = study
    for task in TASKS:
        for cfg in [c for c in _configs(task) if c.get("derived_from")]:
            mine = _load(out, task, cfg["seed"], cfg["name"])["per_rank"]
            base = _load(out, task, cfg["seed"], cfg["derived_from"])["per_rank"]
            for a, b in zip(mine, base):
                common = sorted(set(a["train_losses"]) & set(b["train_losses"]), key=int)
                assert len(common) >= 3, (cfg["name"], common)  # at least two updates compared
                for step in common:
                    assert a["train_losses"][step] == pytest.approx(b["train_losses"][step], abs=1e-4), \
                        (task, cfg["name"], step)


def test_model_state_bytes_are_the_parameter_counts(study):
    out, _, _ = study
    for task in TASKS:
        model = _model(task)
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        for rank in _load(out, task, 0, "ddp")["per_rank"]:  # fp32 parameters, gradients, AdamW's moments, 0-d steps
            assert rank["memory"]["parameters"] == rank["memory"]["gradients"] == 4 * n
            assert rank["memory"]["optimizer_state"] == 8 * n + 4 * len(params)
            meter = rank["meter"]
            assert meter["model_state"] + meter["activations"] + meter["transient"] == meter["total"]
            assert meter["model_state"] >= 12 * n  # parameters and both moments are alive at any moment of a step
        for r, rank in enumerate(_load(out, task, 0, "fsdp")["per_rank"]):  # dim-0 shards as torch.chunk makes
            shard = sum(c[r].numel() if r < len(c := torch.chunk(p.detach(), 4)) else 0 for p in params)
            assert rank["memory"]["parameters"] == 4 * shard, (task, r)
        blocks = [m for name, m in model.named_modules() if name.count(".") == (2 if task == "pysrc" else 1)
                  and name.split(".")[-1].isdigit()]
        per_block = sum(p.numel() for p in blocks[0].parameters())
        assert all(sum(p.numel() for p in b.parameters()) == per_block for b in blocks)
        for rank in _load(out, task, 0, "sdp-block-forward-c0.5")["per_rank"]:  # shared + half the blocks
            assert rank["memory"]["parameters"] == 4 * (n - len(blocks) * per_block + len(blocks) // 2 * per_block)


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
    expected = {"ddp": _mlp_flops(b, 4, 4), "fsdp": _mlp_flops(b, 4, 4), "ddp-halfbatch": _mlp_flops(b // 2, 4, 4),
                "sdp-block-forward-c0.5": _mlp_flops(b, 2, 2), "sdp-block-backward-c0.5": _mlp_flops(b, 4, 2),
                # neuron level: half of each block's hidden units, in the forward regime compact, in the
                # backward regime only their weight gradients (the masked kernels, given formulas)
                "sdp-neuron-forward-c0.5": _mlp_flops(b, 2, 2), "sdp-neuron-backward-c0.5": _mlp_flops(b, 4, 2)}
    # Checkpointing recomputes each block's forward in backward up to the last tensor its backward needs
    # (non-reentrant checkpoints stop early): fc1 and the activation, not fc2, whose output nothing saves.
    expected["ddp-ac"] = _mlp_flops(b, 4, 4) + 4 * 2 * b * 128 * 512
    for name, flops in expected.items():
        for rank in _load(out, "digits", 0, name)["per_rank"]:
            assert rank["counted_step_flops"] == flops, (name, rank["rank"])
    for rank in _load(out, "digits", 0, "ddp-sd-c0.5")["per_rank"]:
        kept = StochasticDepth(_model("digits"), 0.5, 0, rank["rank"]).kept_blocks(0, rank["rank"])
        assert rank["counted_step_flops"] == _mlp_flops(b, sum(kept), sum(kept)), rank["rank"]


def test_linear_stochastic_depth_scales_each_block_by_its_own_survival():
    """In eval mode each block's branches are scaled by 1 - its own drop rate (the rates by hand)."""
    from study_run import LinearStochasticDepth

    torch.manual_seed(0)
    model = _model("digits").eval()
    reference = _model("digits").eval()
    reference.load_state_dict(model.state_dict())
    drops = [0.1, 0.2, 0.3, 0.4]
    LinearStochasticDepth(model, drops, seed=0, rank=0)
    for block, drop in zip(reference.blocks, drops):
        block.fc2.register_forward_hook(lambda m, a, out, p=1 - drop: out * p)
    x = torch.randn(3, 64)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_marks_and_cooldowns_fall_where_the_budgets_are_reached(study):
    out, _, _ = study
    for task in TASKS:
        for seed in SEEDS:
            base = _load(out, task, seed, "ddp")["marks"]["tokens"]
            for cfg in [c for c in _configs(task) if c["seed"] == seed and not c.get("phase_of")]:
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
    for task in TASKS:
        for name in ("sdp-block-forward-c0.5", "sdp-neuron-forward-c0.5"):
            checked = [p for p in _load(out, task, 0, name)["marks"].values() if "subnetwork_check" in p]
            assert checked and all(p["subnetwork_check"] < 1e-5 for p in checked), (task, name)


def test_the_summary_says_what_the_result_files_say(study):
    out, doc, res = study
    with open(os.path.join(os.path.dirname(doc), "study", "summary.json")) as f:
        summary = json.load(f)
    for task in TASKS:
        a = summary["tasks"][task]["analysis"]
        ddp = [_load(out, task, s, "ddp")["marks"]["tokens"]["loss"]["full"] for s in SEEDS]
        assert a["ddp"]["protocols"]["tokens"]["loss"] == pytest.approx(statistics.fmean(ddp))
        peak = lambda name: max(x["meter"]["total"] for s in SEEDS for x in _load(out, task, s, name)["per_rank"])  # noqa: E731
        for name in ("ddp-ac", "sdp-block-forward-c0.5"):
            assert a["runs"][name]["memory"] == pytest.approx(peak(name) / peak("ddp"))
        for name in ("ddp-halfbatch", "sdp-block-forward-c0.5"):
            diffs = [_load(out, task, s, name)["marks"]["flops"]["loss"]["full"] - ddp[s] for s in SEEDS]
            assert a["vs_ddp"][f"{name}|flops"]["mean"] == pytest.approx(statistics.fmean(diffs))
        rows = summary["tasks"][task]["decision"]
        assert rows[0]["tokens"]["run"] in a["runs"] or rows[0]["tokens"]["run"] == "ddp"
        assert [r["budget"] for r in rows] == sorted((r["budget"] for r in rows), reverse=True)


def _branch_worker(rank, world):
    """A cooldown branch restored from a snapshot equals a run that decayed from there directly."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from study_eval import evaluate_method
    from study_measure import register_masked_linear_flops
    from study_run import Run
    from study_worker import _reference, _task

    register_masked_linear_flops()
    profile = dict(PROFILES["tiny"], name="tiny")
    sizes = profile["tasks"]["digits"]
    task = _task(sizes, 0, sizes["batch_size"])
    reference = _reference(task, torch.device("cpu"))
    out = {}
    configs = [{"name": "ddp", "method": "ddp"}, {"name": "ddp-sd-c0.5", "method": "ddp", "stochastic_depth": 0.5},
               {"name": "sdp-block-forward-c0.5", "method": "sdp", "level": "block", "regime": "forward",
                "coverage": 0.5}]
    for extra in configs:
        cfg = dict(extra, task="digits", K=world, seed=0, baseline="ddp")
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
            found = evaluate_method(cfg["method"], run.method, task, list(task.eval_batches()), torch.device("cpu"),
                                    run.stochastic, every_model=False)
            losses.append(found["loss"]["full"])
            run.close()
        out[cfg["name"]] = losses
    return out


def test_a_restored_cooldown_branch_is_a_direct_decay():
    from subnet_ext.testing import run_distributed

    for found in run_distributed(_branch_worker, 2, timeout=600):
        for name, (restored, direct) in found.items():
            assert restored == pytest.approx(direct, abs=1e-6), name


def test_the_learning_rate_schedule_and_the_marks():
    from study_run import lr_factor, linear_drop_rates
    from study_runs import flops_mark, seconds_mark, tokens_mark

    assert tokens_mark(1000, 100) == 10 and tokens_mark(1000, 300) == 4
    assert flops_mark(10.0, lambda s: 3.0, 100) == 4 and flops_mark(10.0, lambda s: 3.0, 3) is None
    assert flops_mark(6.0, lambda s: [1.0, 2.0, 3.0][s], 3) == 3  # stochastic depth: per-step FLOPs differ
    assert seconds_mark(10.0, 0.3, 100) == 34 and seconds_mark(10.0, 0.3, 20) is None
    assert [cooldown_steps(m, 0.2) for m in (1, 2, 10, 250)] == [1, 1, 2, 50]

    assert [lr_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(s, 2, (6, 10)) for s in range(5, 11)] == [1.0, 1.0, 0.75, 0.5, 0.25, 1.0]
    rates = linear_drop_rates(16, 0.5)
    assert rates[0] == pytest.approx(1 / 17) and rates[-1] == pytest.approx(16 / 17)
    assert statistics.fmean(rates) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="coverage of at least 0.5"):
        linear_drop_rates(16, 0.25)


def test_bad_seed_count_is_refused():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "study.py"), "--seeds", "0", "--report-only"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--seeds must be at least 1" in proc.stderr


# ------------------------------------------------------------------------------------- the committed docs
def _block_and_summary(path):
    import study_decision as decision

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
    file the block names, it must come out the same (so nothing there is typed by hand)."""
    import study_decision as decision

    path = os.path.join(REPO, page)
    text, block, summary = _block_and_summary(path)
    link = None
    for line in block.splitlines():
        if line.startswith("From [the study]("):
            link = line.split("](", 1)[1].split(")", 1)[0]
    assert block == decision.render_block(summary, link, decision.block_source(block),
                                          first_task_only=page == "README.md")
    if page == "README.md":  # the example uses the recommended setting
        rec = next(iter(summary["tasks"].values()))["recommended"]
        example = decision.example_setting(text)
        assert (example["level"], example["regime"], example["coverage"]) == (rec["level"], rec["regime"],
                                                                              rec["coverage"])
        assert example["cli"] == (rec["level"], rec["regime"], rec["coverage"])


def test_the_results_page_describes_the_study_as_configured():
    from subnet_ext.models.gpt import GPT_PRESETS

    text = open(os.path.join(REPO, "docs", "results.md")).read()
    deep = GPT_PRESETS[PROFILES["full"]["tasks"]["pysrc"]["preset"]]
    assert f"({deep.n_layer} blocks, so block-level SDP at C = 0.5 keeps {deep.n_layer // 2} blocks" in text
    assert PROFILES["full"]["seeds"] >= 5 and "over at least five seeds" in text
    assert not math.isnan(PROFILES["full"]["cooldown"])
