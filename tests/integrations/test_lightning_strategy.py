"""SDPStrategy in PyTorch Lightning, with real processes started by Lightning's own launcher.

lightning_runs.py runs a LightningModule written for DDP (logging with sync_dist, optimizers
from self.parameters(), validation, test and predict steps) under Lightning's DDPStrategy and
under SDPStrategy, in 2 gloo processes (the script re-run by Lightning's popen launcher), then
resumes a checkpoint in 1 process. The references are independent of SDP: DDPStrategy's runs,
the plain module after fitting evaluated under DDP, a one-process emulation of each rank's
subnetwork (subnet_reference.py), counts of all-reduces made at torch.distributed, and the
checkpoint files themselves. On a GPU (`cuda` mark) the same script's gpu mode trains on one
GPU under Lightning's NCCL group: SDP at coverage 1 against DDP there.
"""
import pytest
import torch
import torch.nn.functional as F

from gpu_marks import needs_cuda
from integration_launch import check_done, load_ranks, require_extra, run_script

require_extra(("lightning",), "lightning")

# K = 2 at coverage 0.5 gives each unit one owner; the planner says so, rightly, every time.
pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")

import subnet_ext as sx  # noqa: E402
from subnet_reference import reference_subnetwork  # noqa: E402

COVERAGE_ONE = ("sdp_c1_neuron_forward", "sdp_c1_block_backward")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both launches, once: {"main": [rank 0, rank 1], "resume": [rank 0], "dir": the output folder}."""
    out = tmp_path_factory.mktemp("lightning")
    check_done(run_script("lightning_runs.py", [out, "main"], timeout=300), "the 2-process Lightning runs")
    check_done(run_script("lightning_runs.py", [out, "resume"], timeout=120), "the 1-process resume")
    return {"main": load_ranks(out, "main", 2), "resume": load_ranks(out, "resume", 1)[0], "dir": out}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _equal_nested(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_nested(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal_nested(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def test_coverage_one_equals_ddp_bit_for_bit(runs):
    """Every logged (sync_dist) loss and the final parameters, with gradient accumulation, in fp32
    and bf16-mixed, both regimes: exactly DDPStrategy's."""
    main = runs["main"][0]
    for name in COVERAGE_ONE:
        assert main[name]["train_loss"] == main["ddp"]["train_loss"], name
        assert _equal_states(main[name]["final"], main["ddp"]["final"]), name
    assert main["sdp_c1_bf16"]["train_loss"] == main["ddp_bf16"]["train_loss"]
    assert _equal_states(main["sdp_c1_bf16"]["final"], main["ddp_bf16"]["final"])
    assert len(main["ddp"]["train_loss"]) == 8


def test_clipping_by_norm_at_coverage_one_matches_ddp(runs):
    """gradient_clip_val (norm): DDP's result up to the summation order of the norm."""
    main = runs["main"][0]
    assert not _equal_states(main["ddp_clip"]["final"], main["ddp"]["final"])  # the clip acts
    assert max(abs(a - b) for a, b in zip(main["sdp_c1_clip"]["train_loss"], main["ddp_clip"]["train_loss"])) < 1e-6
    assert _max_diff(main["sdp_c1_clip"]["final"], main["ddp_clip"]["final"]) < 1e-6


def test_clipping_at_half_coverage_keeps_owners_identical(runs):
    """Clipping by a per-rank norm would scale the shared parameters differently on each rank."""
    for name in ("sdp_c05", "sdp_c05_resumed"):
        assert runs["main"][0][name]["consistency"] == "consistent", name


def test_accumulation_communicates_once_per_optimizer_step(runs):
    """accumulate_grad_batches=2: no all-reduce in the first backward of each step."""
    counts = runs["main"][0]["sdp_c05"]["backward_all_reduces"]
    assert len(counts) == 24
    assert counts[0::2] == [0] * 12 and all(c >= 1 for c in counts[1::2]), counts


def test_loss_falls_at_half_coverage(runs):
    run = runs["main"][0]["sdp_c05"]
    first, last = run["train_loss"][:8], run["train_loss"][-8:]
    assert sum(last) / 8 < sum(first) / 8 - 0.1, run["train_loss"]
    assert run["val_loss"] == sorted(run["val_loss"], reverse=True) and len(run["val_loss"]) == 3, run["val_loss"]


def test_checkpoint_loads_into_the_plain_lightning_module(runs):
    """ModelCheckpoint's file: LitResidual.load_from_checkpoint (no SDP, strict) gives the trained
    model; its optimizer state is the full one (parameter names as keys)."""
    from lightning_runs import LitResidual

    run = runs["main"][0]["sdp_c05"]
    path = runs["dir"] / "ckpts" / "epoch=2.ckpt"
    plain = LitResidual.load_from_checkpoint(path, strict=True)
    assert _equal_states(plain.state_dict(), run["final"])
    assert _equal_states(run["full_state"], run["final"])
    checkpoint = torch.load(path, weights_only=False)
    assert _equal_nested(checkpoint["optimizer_states"][0], run["optimizer"])


def test_resume_continues_the_same_curve(runs):
    """fit(ckpt_path=epoch 0) on the same world size: epochs 1-2 as in the uninterrupted run."""
    main = runs["main"][0]
    assert main["sdp_c05_resumed"]["train_loss"] == main["sdp_c05"]["train_loss"][8:]
    assert _equal_states(main["sdp_c05_resumed"]["final"], main["sdp_c05"]["final"])


def test_resume_on_another_world_size(runs):
    """The 2-process checkpoint resumed by 1 process: the model and the optimizer state start as
    saved, and training continues."""
    checkpoint = torch.load(runs["dir"] / "ckpts" / "epoch=0.ckpt", weights_only=False)
    resumed = runs["resume"]
    assert _equal_states(resumed["loaded_state"], checkpoint["state_dict"])
    assert _equal_nested(resumed["loaded_optimizer"], checkpoint["optimizer_states"][0])
    losses = resumed["resumed_k1"]["train_loss"]
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses)))


def _val_data():
    from lightning_runs import N_VAL, data

    x, y = data(N_VAL, 2).tensors
    return x, y


def _ensemble_logits(state: dict, plan_json: str, consumers: bool) -> torch.Tensor:
    from lightning_runs import LitResidual

    model = LitResidual()
    model.load_state_dict(state)
    plan = sx.SubnetPlan.from_json(plan_json)
    widths = {g.path: (f"{g.path}.fc2", 1) for g in plan.groups} if consumers else None
    x, _ = _val_data()
    with torch.no_grad():
        return torch.stack([reference_subnetwork(model, plan, k, None, widths)(x) for k in range(2)]).mean(0)


def test_full_evaluation_is_the_union_of_the_subnetworks(runs):
    """validation inside fit (evaluation="full") equals the plain module's validation under DDP
    after fitting, and a test run under SDP outside fit."""
    main = runs["main"][0]
    assert main["sdp_c05"]["val_loss"][-1] == main["validate_ddp"] == main["test_full"]


def test_ensemble_evaluation(runs):
    """evaluation="ensemble": validation outside fit (block level) and inside fit (neuron level), and
    predict (each rank its own share of the data) against a one-process emulation of the ranks'
    subnetworks."""
    main = runs["main"]
    _, y = _val_data()
    blocks = _ensemble_logits(main[0]["sdp_c05"]["final"], main[0]["sdp_c05"]["plan"], consumers=False)
    assert abs(main[0]["validate_ensemble"] - F.cross_entropy(blocks, y).item()) < 1e-5
    assert abs(main[0]["validate_ensemble"] - main[0]["validate_ddp"]) > 1e-4  # not the full model
    for rank in range(2):  # the distributed sampler gives rank r the samples r, r + 2, ...
        torch.testing.assert_close(main[rank]["predict_ensemble"], blocks[rank::2], rtol=1e-5, atol=1e-6)
    neuron = main[0]["sdp_c05_neuron_ensemble"]
    neurons = _ensemble_logits(neuron["final"], neuron["plan"], consumers=True)
    assert abs(neuron["val_loss"][-1] - F.cross_entropy(neurons, y).item()) < 1e-5


def test_configure_optimizers_sees_only_trained_parameters(runs):
    """Backward regime, block level: self.parameters() in configure_optimizers trains (the blocks a
    rank does not own are not among them); an optimizer over self.net.blocks.parameters() is refused
    at its first step with the optimizer guard's message, on every rank."""
    main = runs["main"]
    assert "error" not in main[0]["sdp_c05_backward"], main[0]["sdp_c05_backward"]
    assert len(main[0]["sdp_c05_backward"]["train_loss"]) == 8
    for rank in range(2):
        error = main[rank]["stale_error"]
        assert error.startswith("StaleOptimizerError") and f"does not train on rank {rank}" in error, error
        assert "Build it after wrapping" in error


def test_fp16_loss_scaler_skips_on_every_rank(runs):
    """precision "16-mixed": an inf in a block only rank 1 owns (step 2) makes both ranks skip that
    step and halve their scale (torch's own scaler would let rank 0 step)."""
    ranks = [r["sdp_c05_fp16"] for r in runs["main"]]
    assert ranks[0]["scales"] == ranks[1]["scales"] == [256.0] * 2 + [128.0] * 6
    for run in ranks:
        changed = [not torch.equal(run["stem"][i], run["stem"][i - 1]) for i in range(1, 8)]
        assert changed == [True, False] + [True] * 5, changed


def test_lightning_module_of_pre_ln_blocks_plans_and_trains_at_block_level(runs):
    """Issue 40's LightningModule: a ModuleList of pre-LN blocks whose causal mask is built in forward
    (torch.fx cannot trace them), attention by nn.MultiheadAttention, no SDP declaration. SDPStrategy
    plans its blocks (traced on the module's example_input_array) and trains them: every rank's loss
    at every step, and the mean Lightning logs, equal a one-process emulation of the plan (each
    rank's subnetwork on the full model, the owner-mean SGD step; subnet_reference.py), and the
    trained model equals the emulation's."""
    from lightning_runs import VOCAB, LitLM, lm_data
    from subnet_reference import expected_sgd_step

    ranks = [r["lm"] for r in runs["main"]]
    plan = sx.SubnetPlan.from_json(ranks[0]["plan"])
    assert [(g.kind, g.path, g.skip) for g in plan.groups] == [("block", f"blocks.{i}", "identity") for i in range(4)]
    assert not plan.owners.all(0).any()  # at coverage 0.5 each rank skips blocks
    seen = torch.cat([torch.cat(r["batches"]) for r in ranks])  # each rank its own share of the data, once
    assert sorted(seen.tolist()) == sorted(lm_data().tensors[0].tolist())

    def loss(module, k, step):
        ids = ranks[k]["batches"][step]
        return F.cross_entropy(module(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    model = LitLM()
    model.load_state_dict(runs["main"][0]["lm_initial"])
    assert len(ranks[0]["local"]) == 4
    for step in range(4):
        refs = [reference_subnetwork(model, plan, k) for k in range(2)]
        with torch.no_grad():
            want = [loss(refs[k], k, step).item() for k in range(2)]
        for k in range(2):
            assert abs(ranks[k]["local"][step] - want[k]) < 1e-5, (step, k, ranks[k]["local"][step], want[k])
            assert abs(ranks[k]["logged"][step] - sum(want) / 2) < 1e-5, (step, k)
        expected = expected_sgd_step(model, plan, refs, lambda m, k: loss(m, k, step), 0.1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(expected[name])
    assert _max_diff(ranks[0]["final"], model.state_dict()) < 1e-5


@needs_cuda
def test_one_gpu_under_nccl_equals_ddp(tmp_path):
    """Coverage 1 on one GPU computes DDP's updates: every logged loss and the final weights, fp32
    with and without clipping, and bf16-mixed (GEMMs on the GPU may add in other orders)."""
    check_done(run_script("lightning_runs.py", [tmp_path, "gpu"], timeout=85), "the 1-GPU Lightning runs")
    run = load_ranks(tmp_path, "gpu", 1)[0]
    assert run["backend"] == "nccl" and run["device"].startswith("cuda"), (run["backend"], run["device"])
    for sdp, ddp, rel in (("sdp_neuron_forward", "ddp", 1e-5), ("sdp_block_backward_clip", "ddp_clip", 1e-5),
                          ("sdp_bf16", "ddp_bf16", 2e-2)):
        assert run[sdp]["train_loss"] == pytest.approx(run[ddp]["train_loss"], rel=rel), sdp
        assert _max_diff(run[sdp]["final"], run[ddp]["final"]) < 50 * rel, sdp
