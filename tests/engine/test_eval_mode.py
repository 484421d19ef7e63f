"""`sdp.eval(); sdp(x)` in a torchvision-style evaluate loop, on 2 gloo ranks.

The loop is torchvision's references/classification `evaluate()` reduced to its habits:
`model.eval()`, `torch.inference_mode()`, the wrapper called on each batch of this rank's
validation shard, loss and top-1 summed, the sums all-reduced at the end
(`metric_logger.synchronize_between_processes()`). A ResidualMLP at neuron level, forward
regime, coverage 0.5 (each rank holds half of the hidden units):

- eval_forward="subnetwork" (the default): the loop reports this rank's subnetwork, equal to
  `sdp.evaluate(x, modes=("subnetwork",))`; one warning per process (not per call, not per
  loop) names the rank's subnetwork and points to evaluate();
- eval_forward="full": the loop reports the full model, equal to the same loop run on a fresh
  ResidualMLP loaded with `full_state_dict()` (torch's own model, no engine); one assembly per
  optimizer step (counted), a fresh one after a step (in train mode, or taken in eval mode with
  gradients: the subnetwork trains there), and no warning;
- coverage 1, and the backward regime: eval-mode forwards run the rank's model as it is, equal to
  the full model, without a warning.
"""
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model, train
from subnet_ext.testing import run_distributed

BATCHES = 3


@torch.no_grad()
def torchvision_evaluate(model, rank):
    """(mean loss, top-1 accuracy) over every rank's validation shard, as torchvision's evaluate()."""
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)
    with torch.inference_mode():
        for k in range(BATCHES):
            image, target = batch(rank, 500 + k)
            output = model(image)
            loss = F.cross_entropy(output, target)
            total += torch.tensor([loss.item() * len(target), (output.argmax(1) == target).sum().item(),
                                   len(target)], dtype=torch.float64)
    dist.all_reduce(total)  # metric_logger.synchronize_between_processes()
    return float(total[0] / total[2]), float(total[1] / total[2])


def _fresh_model_on(state):
    model = make_model(seed=99)  # other initial values: everything comes from `state`
    model.load_state_dict(state)
    return model


def _counting_assemblies(sdp):
    calls = [0]
    original = sdp.full_state_dict

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    sdp.full_state_dict = counted
    return calls


def _subnetwork_outputs(sdp, rank):
    return [sdp.evaluate(batch(rank, 500 + k)[0], modes=("subnetwork",))["subnetwork"] for k in range(BATCHES)]


def _worker(rank, world):
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The default: this rank's subnetwork, said once.
        model = make_model()
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"))
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        train(sdp, opt, rank, 2)
        metrics = [torchvision_evaluate(sdp, rank) for _ in range(2)]  # two loops, one warning
        sdp.eval()
        with torch.no_grad():
            own = [sdp(batch(rank, 500 + k)[0]) for k in range(BATCHES)]
        out["subnetwork_is_own"] = all(torch.equal(a, b) for a, b in zip(own, _subnetwork_outputs(sdp, rank)))
        out["subnetwork_metrics_repeat"] = metrics[0] == metrics[1]
        full_reference = torchvision_evaluate(_fresh_model_on(sdp.full_state_dict()), rank)
        out["subnetwork_differs_from_full"] = metrics[0] != full_reference
        out["subnetwork_warnings"] = [str(w.message) for w in caught if "eval mode" in str(w.message)]
        caught.clear()

        # eval_forward="full": the assembled model, once per step.
        model = make_model()
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, "neuron"), eval_forward="full")
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        train(sdp, opt, rank, 2)
        assemblies = _counting_assemblies(sdp)
        first = [torchvision_evaluate(sdp, rank) for _ in range(2)]
        out["full_first"] = (first, torchvision_evaluate(_fresh_model_on(sdp.full_state_dict()), rank))
        out["assemblies_for_two_loops"] = assemblies[0] - 1  # less the reference's own full_state_dict
        sdp.train()
        train(sdp, opt, rank, 1, start=2)
        after = torchvision_evaluate(sdp, rank)
        out["full_after_step"] = (after, torchvision_evaluate(_fresh_model_on(sdp.full_state_dict()), rank))
        # A step taken in eval mode (gradients recorded: the subnetwork trains) makes the next
        # evaluation assemble again, without a return to train mode.
        train(sdp, opt, rank, 1, start=3)
        out["full_after_eval_mode_step"] = (torchvision_evaluate(sdp, rank),
                                            torchvision_evaluate(_fresh_model_on(sdp.full_state_dict()), rank), after)
        out["full_warnings"] = [str(w.message) for w in caught if "eval mode" in str(w.message)]
        caught.clear()

        # Ranks that hold the whole model run it as it is, in either mode, without a word.
        for label, coverage, regime in (("coverage_one", 1.0, "forward"), ("backward", 0.5, "backward")):
            model = make_model()
            sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, coverage, "neuron"), regime=regime)
            opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
            train(sdp, opt, rank, 2)
            out[label] = (torchvision_evaluate(sdp, rank),
                          torchvision_evaluate(_fresh_model_on(sdp.full_state_dict()), rank))
        out["whole_model_warnings"] = [str(w.message) for w in caught if "eval mode" in str(w.message)]
    return out


def test_eval_mode_in_a_torchvision_evaluate_loop():
    results = run_distributed(_worker, 2)
    for rank, r in enumerate(results):
        assert r["subnetwork_is_own"] and r["subnetwork_metrics_repeat"], rank
        assert r["subnetwork_differs_from_full"], rank  # the premise: a subnetwork is not the model here
        assert len(r["subnetwork_warnings"]) == 1, r["subnetwork_warnings"]
        message = r["subnetwork_warnings"][0]
        assert f"ran rank {rank}'s subnetwork (" in message and "coverage 0.5" in message, message
        assert "sdp.evaluate(x)" in message and "eval_forward='full'" in message, message

        first, reference = r["full_first"]
        assert first[0] == first[1] == reference, (first, reference)
        assert r["assemblies_for_two_loops"] == 1, r["assemblies_for_two_loops"]
        after, reference_after = r["full_after_step"]
        assert after == reference_after and after != first[0], (after, reference_after, first)
        mine, reference, before = r["full_after_eval_mode_step"]
        assert mine == reference and mine != before, (mine, reference, before)
        assert r["full_warnings"] == [], r["full_warnings"]

        for label in ("coverage_one", "backward"):
            mine, reference = r[label]
            assert mine == reference, (label, mine, reference)
        assert r["whole_model_warnings"] == [], r["whole_model_warnings"]
    # The metrics are all-reduced: every rank reports the same numbers.
    assert results[0]["full_first"] == results[1]["full_first"]
