"""plan_for_memory and `subnet-plan --memory-budget` (subnet_ext/planning/costs/budget.py).

For three models (the study's residual MLP and GPT, the bundled LLaMA), a budget is set
between two candidates' predictions; the chosen configuration is built and one rank's real
training step metered (tests/memory_steps.py): its measured peak must fit the budget and be
within 10% of the prediction. Also: the nothing-fits error, size parsing, the CLI flag, and
that PREFERENCE follows the committed schedules sweep's losses.
"""
import copy
import json
import os

import pytest
import torch

import subnet_ext as sx
from memory_steps import MIB, gpt_task, measure_rank_step, mlp_task
from subnet_ext.cli.plan import main as subnet_plan
from subnet_ext.models import build_model
from subnet_ext.planning.costs.budget import MARGIN, PREFERENCE, QUALITY_NOTE
from subnet_ext.planning.costs.sizes import parse_size

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def llama_task(batch=2, seq_len=32):
    torch.manual_seed(0)
    model = build_model("llama", preset="tiny")
    return model, torch.randint(0, 256, (batch, seq_len)), torch.randint(0, 256, (batch, seq_len))


def _budget_between(candidates):
    """A budget halfway between what a candidate needs (its prediction with the planner's margin)
    and the least that any candidate preferred to it needs, so the planner must pass over those;
    only candidates one simulated rank can run (no FSDP2 sharding)."""
    need = [c.predicted["total"] * (1 + MARGIN) for c in candidates]
    for i, c in enumerate(candidates):
        if i and not c.shard_shared and min(need[:i]) > need[i]:
            return (need[i] + min(need[:i])) / 2
    pytest.fail("no two candidates to put a budget between")


@pytest.mark.parametrize("task", [mlp_task, gpt_task, llama_task], ids=["mlp", "gpt", "llama"])
def test_the_chosen_configuration_fits_when_measured(task):
    model, x, y = task()
    everything = sx.plan_for_memory(model, 4, "1TiB", sample_input=x, verbose=False)
    budget = int(_budget_between(everything.candidates))
    fit = sx.plan_for_memory(model, 4, budget, sample_input=x, verbose=False)
    assert fit.choice.name != everything.choice.name  # the budget ruled out the most preferred
    assert fit.predicted["total"] * (1 + MARGIN) <= budget and not fit.sdp_kwargs["shard_shared"]
    measured = measure_rank_step(model, fit.plan, x, y, rank=fit.predicted["rank"], regime=fit.sdp_kwargs["regime"],
                                 activation_checkpointing=fit.activation_checkpointing)["total"]
    assert measured <= budget, f"measured {measured / MIB:.2f} MiB over the budget {budget / MIB:.2f} MiB"
    assert abs(measured - fit.predicted["total"]) <= 0.10 * measured, (measured, fit.predicted)


def test_a_budget_per_rank_gives_each_rank_its_coverage_and_each_fits_when_measured():
    """Two ranks with the memory of C = 1 and two with less: the planner gives the large ranks every
    block and the small ones fewer (a coverage per rank no uniform candidate reaches), and each
    rank's real step, metered, fits its own budget."""
    model, x, y = gpt_task()
    tried = sx.plan_for_memory(model, 4, "1TiB", sample_input=x, verbose=False).candidates
    need = {c.coverage: c.rank_totals[0] * (1 + MARGIN) for c in tried
            if (c.level, c.regime, c.shard_shared, c.activation_checkpointing) == ("block", "forward", False, False)}
    large, small = int(need[1.0]) + MIB, int(need[0.5]) + MIB // 4  # C = 1 on the large, C = 0.5 on the small
    assert small < need[0.75]  # so no uniform coverage above 0.5 fits every rank
    fit = sx.plan_for_memory(model, 4, [large, large, small, small], sample_input=x, verbose=False)
    assert fit.choice.coverage == (1.0, 1.0, 0.5, 0.5) and fit.budget == [large, large, small, small]
    held = fit.plan.owners.sum(1).tolist()  # units per rank, counted from the plan's owner matrix
    assert held[0] == held[1] == fit.plan.owners.shape[1] and held[2] == held[3] == fit.plan.owners.shape[1] // 2
    for rank, budget in enumerate([large, large, small, small]):
        measured = measure_rank_step(copy.deepcopy(model), fit.plan, x, y, rank=rank,
                                     regime=fit.sdp_kwargs["regime"])["total"]
        assert measured <= budget, (rank, measured / MIB, budget / MIB)


def test_budgets_per_rank_are_checked():
    model, x, _ = mlp_task()
    with pytest.raises(ValueError, match="3 budgets for world size 4"):
        sx.plan_for_memory(model, 4, ["1GiB"] * 3, sample_input=x, verbose=False)
    same = sx.plan_for_memory(model, 4, ["1GiB"] * 4, sample_input=x, verbose=False)
    assert same.choice.name == sx.plan_for_memory(model, 4, "1GiB", sample_input=x, verbose=False).choice.name
    assert same.budget == 2 ** 30  # equal budgets are one budget


def test_nothing_fits_names_the_budget_and_the_smallest_peak():
    model, x, _ = mlp_task()
    with pytest.raises(sx.NoConfigurationFits, match=r"budget of 0\.50 MiB .* smallest predicted peak is") as e:
        sx.plan_for_memory(model, 4, "512KiB", sample_input=x, verbose=False)
    smallest = min(c.predicted["total"] for c in e.value.candidates)
    assert f"{smallest / MIB:.2f} MiB" in str(e.value)


@pytest.mark.parametrize("text,size", [("8GiB", 8 * 2 ** 30), ("512MiB", 512 * 2 ** 20), ("1.5GB", 1_500_000_000),
                                       ("4096", 4096), (" 2 kib ", 2048)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["8QiB", "GiB", "-1GiB", "0", "eight"])
def test_bad_sizes_are_refused_by_name(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_cli_memory_budget(capsys):
    assert subnet_plan(["--model", "gpt", "--preset", "deep", "--world-size", "4", "--memory-budget", "9MiB",
                        "--batch-size", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "| configuration |" in out and "chosen" in out and "SubnetDataParallel(model, plan, regime=" in out
    assert subnet_plan(["--model", "gpt", "--preset", "deep", "--memory-budget", "1MiB"]) == 1
    assert "nothing fits a budget of 1.00 MiB" in capsys.readouterr().err
    assert subnet_plan(["--model", "gpt", "--world-size", "4", "--memory-budget", "1GiB,1GiB"]) == 1
    assert "2 budgets for world size 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        subnet_plan(["--model", "gpt", "--memory-budget", "8QiB"])
    assert "not a memory size: '8QiB'" in capsys.readouterr().err


def test_preference_follows_the_study():
    """From most to fewest owners per unit (C = 1 first, one owner last); at C = 0.5 the forward
    regime's neuron level before its block level, as their static full models rank at equal tokens
    in the committed schedules sweep on Tiny Shakespeare (docs/study-schedules/summary.json)."""
    with open(os.path.join(REPO, "docs", "study-schedules", "summary.json")) as f:
        per_seed = json.load(f)["tasks"]["shakespeare"]["per_seed"]

    def loss(name):
        values = [v for v in per_seed[f"K4/{name}"]["tokens"]["full"].values() if v is not None]
        assert values, name
        return sum(values) / len(values)

    forward_half = [level for level, regime, c in PREFERENCE if c == 0.5 and regime == "forward"]
    assert forward_half == sorted(forward_half, key=lambda level: loss(f"sdp-{level}-forward-c0.5"))
    assert PREFERENCE[0][2] == 1.0 and PREFERENCE[-1][2] == "1/K"
    assert [c for _, _, c in PREFERENCE] == [1.0] + [0.5] * (len(PREFERENCE) - 2) + ["1/K"]


def test_a_partitioning_choice_says_quality_is_the_users(capsys):
    """plan_for_memory orders by memory: a choice below C = 1 prints the note that it promises no quality."""
    model, _, _ = mlp_task()
    sx.plan_for_memory(model, 4, "1GiB", optimizer=torch.optim.SGD)
    assert QUALITY_NOTE not in capsys.readouterr().out  # C = 1 fits: DDP's updates, nothing to say
    tried = sx.plan_for_memory(model, 4, "1GiB", optimizer=torch.optim.SGD, verbose=False).candidates
    smallest_at_c1 = min(c.predicted["total"] for c in tried if c.plan.owners.sum(0).min() == 4)
    fit = sx.plan_for_memory(model, 4, int(smallest_at_c1 * (1 + MARGIN)) - 1, optimizer=torch.optim.SGD)
    assert fit.plan.owners.sum(0).min() < 4 and QUALITY_NOTE in capsys.readouterr().out


def test_without_a_sample_only_model_state_is_counted(capsys):
    model, _, _ = mlp_task()
    fit = sx.plan_for_memory(model, 4, "1GiB", optimizer=torch.optim.SGD, verbose=True)
    assert "activations not counted" in capsys.readouterr().out
    assert fit.predicted["activations"] == 0 and fit.predicted["optimizer_state"] == 0  # plain SGD keeps none
    assert not any(c.activation_checkpointing for c in fit.candidates)  # nothing traced to checkpoint
    assert fit.choice.coverage == 1.0 and fit.sdp_kwargs == {"regime": "forward", "shard_shared": False}


def test_every_owner_count_from_k_down_to_1_is_tried_in_order(capsys):
    """At K = 8 the candidates' plans hold 8, 7, ..., 1 owners per unit (counted in their owner
    matrices), never fewer before more; a budget that 3 owners fit and 4 do not chooses 3 (it
    used to jump from C = 0.5 to 1/8); one progress line per owner count goes to stderr."""
    model, x, _ = gpt_task()
    everything = sx.plan_for_memory(model, 8, "1TiB", sample_input=x, verbose=True)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plan_for_memory:")]
    counts = []
    for c in everything.candidates:
        owners = set(c.plan.owners.sum(0).tolist())
        assert len(owners) == 1 and c.coverage == owners.pop() / 8
        counts.append(round(c.coverage * 8))
    assert sorted(set(counts), reverse=True) == list(range(8, 0, -1)) and counts == sorted(counts, reverse=True)
    assert len(progress) == 8 and progress[-1].startswith("plan_for_memory: 8/8") and "1 of 8 owners" in progress[-1]
    # A budget between the best 3-owner candidate's need and every 4-owner one's.
    need = lambda c: c.predicted["total"] * (1 + MARGIN)  # noqa: E731
    three = min(need(c) for c in everything.candidates if round(c.coverage * 8) == 3)
    four = min(need(c) for c in everything.candidates if round(c.coverage * 8) >= 4)
    assert three < four
    fit = sx.plan_for_memory(model, 8, int((three + four) / 2), sample_input=x, verbose=False)
    assert fit.plan.owners.sum(0).unique().tolist() == [3]


@pytest.mark.parametrize("level", ["block", "neuron"])
def test_a_plan_from_the_model_units_is_the_plan_of_the_model(level):
    """plan_for_memory reads the model once per level (model_units) and plans every owner count
    from it: each such plan is plan_subnetworks' plan, in every field of its JSON."""
    from subnet_ext.planning.plan import model_units, plan_from_units

    model, x, _ = gpt_task()
    units = model_units(model, level, sample_input=x)
    for world, coverage, seed in ((8, 0.375, 0), (4, 0.5, 3), (4, 1.0, 1)):
        expected = sx.plan_subnetworks(model, world, coverage, level, seed, sample_input=x)
        assert plan_from_units(units, world, coverage, seed).to_json() == expected.to_json()
