"""SDPTrainer in the Hugging Face Trainer, with real processes (2 gloo ranks, torchrun's environment).

hf_runs.py trains a tiny LLaMA-style causal LM built from a config (no download) with the plain
`transformers.Trainer` (accelerate wraps it in DDP) and with SDPTrainer, the only line that
changes: gradient accumulation, max_grad_norm, bf16, evaluation during training, checkpoints,
resume and save_model. The references are independent of SDP: the plain Trainer's DDP runs,
the trained model evaluated after training, `AutoModelForCausalLM.from_pretrained` on what was
saved, a one-process emulation of the ranks' subnetworks (subnet_reference.py) and counts of
all-reduces made at torch.distributed. On a GPU (`cuda` mark) the same script's gpu mode runs one
process on the GPU: SDPTrainer at coverage 1 against the plain Trainer there.
"""
import pytest
import torch

from gpu_marks import needs_cuda
from integration_launch import load_ranks, require_extra, run_ranks

require_extra(("transformers", "accelerate", "safetensors"), "hf")

# K = 2 at coverage 0.5 gives each unit one owner; the planner says so, rightly, every time.
pytestmark = pytest.mark.filterwarnings("ignore:SubnetPlan. ranks")

import subnet_ext as sx  # noqa: E402
from subnet_reference import reference_subnetwork  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process runs, once: {"ranks": [rank 0, rank 1], "dir": the output folder}."""
    out = tmp_path_factory.mktemp("hf")
    run_ranks("hf_runs.py", [out], world_size=2, timeout=300, log_dir=out)
    return {"ranks": load_ranks(out, "main", 2), "dir": out}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_coverage_one_equals_the_plain_trainers_ddp(runs):
    """Every logged loss and evaluation loss, the grad norms, and the final weights: fp32, and bf16
    with max_grad_norm clipping, with gradient accumulation."""
    main = runs["ranks"][0]
    for sdp, ddp in (("sdp_c1", "ddp"), ("sdp_c1_bf16", "ddp_bf16")):
        assert main[sdp]["loss"] == main[ddp]["loss"] and len(main[ddp]["loss"]) == 6, (sdp, ddp)
        assert main[sdp]["eval_loss"] == main[ddp]["eval_loss"] and len(main[ddp]["eval_loss"]) == 2
        torch.testing.assert_close(torch.tensor(main[sdp]["grad_norm"]), torch.tensor(main[ddp]["grad_norm"]),
                                   rtol=1e-5, atol=0)
    assert _equal_states(main["sdp_c1"]["final"], main["ddp"]["final"])
    # A step that clipping scales differs in the last bits of the coefficient: the norms are summed
    # in another order (docs/porting.md).
    assert max(main["ddp_bf16"]["grad_norm"]) > 0.5  # the clip acts
    clipped, reference = main["sdp_c1_bf16"]["final"], main["ddp_bf16"]["final"]
    assert max((clipped[k] - reference[k]).abs().max().item() for k in reference) < 1e-6


def test_the_model_is_wrapped_once(runs):
    """SDPTrainer trains the model inside SubnetDataParallel and no DDP; the plain Trainer in DDP."""
    main = runs["ranks"][0]
    for name in ("sdp_c1", "sdp_c1_bf16", "sdp_c05", "sdp_c05_resumed"):
        assert main[name]["wrappers"] == [("SubnetDataParallel", ())], name
    assert main["ddp"]["wrappers"] == [("DistributedDataParallel", ("DistributedDataParallel",))]


def test_accumulation_communicates_once_per_optimizer_step(runs):
    """gradient_accumulation_steps=2: no all-reduce in the first micro-batch of a step."""
    for rank in runs["ranks"]:
        run = rank["sdp_c05"]
        assert run["first_micro_batch"] == [0] * 6, run["first_micro_batch"]
        assert all(n >= 1 for n in run["last_micro_batch"]) and len(run["last_micro_batch"]) == 6


def test_half_coverage_trains_and_evaluates_the_full_model(runs):
    """The loss falls; the evaluation during training is the full model's: the last one equals
    evaluate() after training on the model SDPTrainer gave back."""
    run = runs["ranks"][0]["sdp_c05"]
    assert sum(run["loss"][-2:]) < sum(run["loss"][:2]) - 0.2, run["loss"]
    assert run["eval_loss"][1] < run["eval_loss"][0]
    assert run["eval_loss"][-1] == runs["ranks"][0]["evaluate_after"]


def test_max_grad_norm_clips_by_the_whole_models_norm(runs):
    """At coverage 0.5 the logged norm is the same on both ranks (each holds other blocks), and
    owners stay bit-identical after every clipped step."""
    ranks = [r["sdp_c05"] for r in runs["ranks"]]
    assert ranks[0]["grad_norm"] == ranks[1]["grad_norm"] and min(ranks[0]["grad_norm"]) > 0.5
    assert ranks[0]["inconsistent"] == [] and ranks[1]["inconsistent"] == []


def _eval_ids():
    from hf_runs import Sequences

    return Sequences(16, 2).ids


def test_saved_model_loads_with_from_pretrained_and_evaluates(runs):
    from transformers import AutoModelForCausalLM

    main = runs["ranks"][0]
    for folder in ("saved", "sdp_c05/checkpoint-6"):
        model = AutoModelForCausalLM.from_pretrained(runs["dir"] / folder).eval()
        assert _equal_states(model.state_dict(), main["sdp_c05"]["final"]), folder
    ids = _eval_ids()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - main["evaluate_after"]) < 1e-4  # fp32 here, the run's evaluation in bf16 autocast


def test_resume_from_a_trainer_checkpoint_continues_the_same_run(runs):
    """resume_from_checkpoint=checkpoint-3 (weights, full optimizer state, scheduler, RNG): steps
    4-6 as in the uninterrupted run."""
    main = runs["ranks"][0]
    assert main["sdp_c05_resumed"]["loss"] == main["sdp_c05"]["loss"]
    assert main["sdp_c05_resumed"]["eval_loss"] == main["sdp_c05"]["eval_loss"]
    assert _equal_states(main["sdp_c05_resumed"]["final"], main["sdp_c05"]["final"])
    optimizer = torch.load(runs["dir"] / "sdp_c05" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert "model.layers.0.self_attn.q_proj.weight" in optimizer["state"]  # the full state, by name


def test_ensemble_evaluation(runs):
    """SDPOptions(evaluation="ensemble"): the loss of the mean of the 2 subnetworks' logits, each rank
    on its share of the evaluation data, against a one-process emulation of the subnetworks."""
    from hf_runs import make_model

    main = runs["ranks"][0]
    model = make_model().eval()
    model.load_state_dict(main["sdp_c05"]["final"])
    plan = sx.SubnetPlan.from_json(main["sdp_c05"]["plan"])
    ids = _eval_ids()
    with torch.no_grad():
        logits = torch.stack([reference_subnetwork(model, plan, k)(input_ids=ids).logits for k in range(2)]).mean(0)
        expected = model.loss_function(logits=logits, labels=ids, vocab_size=model.config.vocab_size).item()
    assert abs(main["evaluate_ensemble"] - expected) < 1e-5
    assert abs(main["evaluate_ensemble"] - main["evaluate_after"]) > 1e-3  # not the full model


def test_fp16_loss_scaler_skips_on_every_rank(runs):
    """fp16=True: an inf in a block only rank 1 owns (step 3) makes both ranks skip that step and
    halve their scale (accelerate's torch scaler would let rank 0 step)."""
    ranks = [r["sdp_c05_fp16"] for r in runs["ranks"]]
    assert ranks[0]["scales"] == ranks[1]["scales"] == [256.0] * 2 + [128.0] * 4
    for run in ranks:
        changed = [not torch.equal(run["embedding"][i], run["embedding"][i - 1]) for i in range(1, 6)]
        assert changed == [True, False, True, True, True], changed


@needs_cuda
def test_one_gpu_process_equals_the_plain_trainer(tmp_path):
    """Coverage 1 in one process on the GPU: the plain Trainer's losses, gradient norms and final
    weights, fp32 and bf16 with clipping (GEMMs on the GPU may add in other orders)."""
    run_ranks("hf_runs.py", [tmp_path, "gpu"], world_size=1, timeout=85, log_dir=tmp_path)
    run = load_ranks(tmp_path, "gpu", 1)[0]
    assert run["device"].startswith("cuda"), run["device"]
    for sdp, plain, rel in (("sdp_c1", "ddp", 1e-5), ("sdp_c1_bf16", "ddp_bf16", 2e-2)):
        assert run[sdp]["loss"] == pytest.approx(run[plain]["loss"], rel=rel), sdp
        assert run[sdp]["grad_norm"] == pytest.approx(run[plain]["grad_norm"], rel=10 * rel), sdp
        diff = max((run[sdp]["final"][k].float() - v.float()).abs().max().item() for k, v in run[plain]["final"].items())
        assert diff < 50 * rel, (sdp, diff)
