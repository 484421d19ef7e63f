"""evaluate() on models whose output is not one tensor, with and without a loss function.

2 gloo ranks, block level, coverage 0.5 (each rank owns other blocks, so every rank's
subnetwork differs from the other's and from the full model), one SGD step of training.
References, computed here in one process: the full model is a fresh instance holding the
assembled full state; rank r's subnetwork is that model with the blocks r does not own
replaced by the identity (subnet_reference.py, read off the plan's owner matrix); the
ensemble is the mean of the references' floating outputs, and each loss is the loss
function applied to those outputs. Outputs: a (logits, loss) tuple as nanoGPT's, a dict
with a list and an integer tensor, a frozen dataclass pytree does not know, and
transformers' CausalLMOutputWithCrossAttentions (a registered ModelOutput) from a tiny
GPT-2. (The tuple comes from a residual MLP: subnet_ext.models.gpt's pre-LN blocks are
skipped through their attention by the planner this test was written against, so its
subnetworks are not yet the identity-skipped reference.)
"""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model, value_error
from subnet_ext.testing import run_distributed
from subnet_reference import reference_subnetwork

VOCAB, TOL = 32, 1e-5


@dataclasses.dataclass(frozen=True)
class Prediction:
    """An output type torch's pytree does not know."""

    logits: torch.Tensor
    extras: tuple
    note: str = "plain"
    nothing: torch.Tensor | None = None


class TupleOutput(nn.Module):
    """ResidualMLP with nanoGPT's signature: forward(x, targets) -> (logits, mean cross-entropy)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x, targets):
        logits = self.net(x)
        return logits, F.cross_entropy(logits, targets)


class DictOutput(nn.Module):
    """ResidualMLP returning {"logits", "features": [h, 2 h], "count": int64}."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        logits = self.net(x)
        return {"logits": logits, "features": [logits.tanh(), 2 * logits], "count": torch.tensor(len(x))}


class DataclassOutput(DictOutput):
    """ResidualMLP returning a frozen Prediction dataclass."""

    def forward(self, x):
        logits = self.net(x)
        return Prediction(logits=logits, extras=(logits.sigmoid(), torch.arange(3)))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      attn_implementation="eager"))


def tokens(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)


def logits_of(output):
    """The logits in any of the outputs here."""
    if isinstance(output, tuple):
        return output[0]
    return output["logits"] if isinstance(output, dict) else output.logits


def lm_loss(output, targets):
    return F.cross_entropy(logits_of(output).reshape(-1, VOCAB), targets.reshape(-1))


def class_loss(output, y):
    return F.cross_entropy(logits_of(output), y)


# name: (build, training loss(model, rank), evaluation inputs, loss_fn, targets, block paths or None)
def cases():
    x, y = batch(99, 0)
    ids, targets = tokens(99)
    return {
        "tuple": (TupleOutput, lambda m, r: m(*batch(r, 0))[1], (x, y), class_loss, y, None),
        "dict": (DictOutput, lambda m, r: class_loss(m(batch(r, 0)[0]), batch(r, 0)[1]), (x,), class_loss, y, None),
        "dataclass": (DataclassOutput, lambda m, r: class_loss(m(batch(r, 0)[0]), batch(r, 0)[1]), (x,), class_loss,
                      y, None),
        "model_output": (gpt2, lambda m, r: lm_loss(m(tokens(r)[0]), tokens(r)[1]), (ids,), lm_loss, targets, None),
    }


def floats(output) -> list:
    """The floating tensors of `output`, walked by hand (not by the code under test)."""
    if torch.is_tensor(output):
        return [output] if output.is_floating_point() else []
    if dataclasses.is_dataclass(output) and not hasattr(output, "to_tuple"):
        return [t for f in dataclasses.fields(output) for t in floats(getattr(output, f.name))]
    if hasattr(output, "to_tuple"):  # transformers' ModelOutput
        return [t for v in output.to_tuple() for t in floats(v)]
    if isinstance(output, dict):
        return [t for k in sorted(output) for t in floats(output[k])]
    if isinstance(output, (tuple, list)):
        return [t for v in output for t in floats(v)]
    return []


def worst(got, want) -> float:
    """max |got - want| over matching floating tensors (inf when they do not match up)."""
    a, b = floats(got), floats(want)
    if len(a) != len(b) or not a or any(x.shape != y.shape or x.dtype != torch.float32 for x, y in zip(a, b)):
        return float("inf")
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _case(rank, world, name):
    build, train_loss, inputs, loss_fn, targets, blocks = cases()[name]
    model = build()
    plan = sx.plan_subnetworks(model, world, 0.5, "block", blocks=blocks)
    sdp = sx.SubnetDataParallel(model, plan, regime="forward")
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    train_loss(sdp, rank).backward()
    opt.step()
    opt.zero_grad()
    plain = sdp.evaluate(*inputs, modes=("full", "ensemble", "subnetwork"))
    scored = sdp.evaluate(*inputs, modes=("full", "ensemble", "subnetwork"), loss_fn=loss_fn, targets=targets)
    full_ref = build()
    full_ref.load_state_dict(sdp.full_state_dict())
    refs = [reference_subnetwork(full_ref, plan, r).eval() for r in range(world)]
    with torch.no_grad():
        want_full, want_subs = full_ref.eval()(*inputs), [ref(*inputs) for ref in refs]
    want_ensemble = [torch.stack(ts).mean(0) for ts in zip(*(floats(s) for s in want_subs))]
    out = {"keys": (sorted(plain), sorted(scored), sorted(scored["loss"])),
           "types": [type(plain[m]).__name__ for m in ("full", "ensemble", "subnetwork")] + [type(want_full).__name__]}
    for results in (plain, scored):
        out.setdefault("full", []).append(worst(results["full"], want_full))
        out.setdefault("subnetwork", []).append(worst(results["subnetwork"], want_subs[rank]))
        got = floats(results["ensemble"])
        out.setdefault("ensemble", []).append(max((a - b).abs().max().item() for a, b in zip(got, want_ensemble))
                                              if len(got) == len(want_ensemble) else float("inf"))
    out["subnetworks_differ"] = worst(want_subs[0], want_subs[1]) > 1e-3 and worst(want_subs[0], want_full) > 1e-3
    losses = scored["loss"]
    out["loss_full"] = abs(losses["full"].item() - loss_fn(want_full, targets).item())
    out["loss_subnetworks"] = (losses["subnetworks"].shape, max(abs(losses["subnetworks"][r].item() -
                                                                    loss_fn(want_subs[r], targets).item())
                                                                for r in range(world)))
    ensemble_logits = torch.stack([logits_of(s) for s in want_subs]).mean(0)
    out["loss_ensemble"] = abs(losses["ensemble"].item() - (
        F.cross_entropy(ensemble_logits.reshape(-1, VOCAB), targets.reshape(-1)) if ensemble_logits.dim() == 3
        else F.cross_entropy(ensemble_logits, targets)).item())
    out["passthrough"] = _passthrough(name, scored["ensemble"], rank)
    return out


def _passthrough(name, ensemble, rank):
    """What evaluate keeps of the non-floating leaves of the ensemble's output."""
    if name == "dict":
        return ensemble["count"].dtype == torch.int64 and ensemble["count"].item() == 8 and \
            isinstance(ensemble["features"], list)
    if name == "dataclass":
        return ensemble.note == "plain" and ensemble.nothing is None and torch.equal(ensemble.extras[1],
                                                                                     torch.arange(3))
    return True


def _tensor_and_errors(rank, world):
    """The old call evaluate(x) on a tensor model, a simulated rank, and bad requests."""
    model = make_model()
    plan = sx.plan_subnetworks(model, world, 0.5, "block")
    sdp = sx.SubnetDataParallel(model, plan, regime="forward")
    x, y = batch(99, 0)
    out = {"old_keys": sorted(sdp.evaluate(x))}
    full_ref = make_model()
    full_ref.load_state_dict(sdp.full_state_dict())
    with torch.no_grad():
        out["old_full"] = (sdp.evaluate(x)["full"] - full_ref.eval()(x)).abs().max().item()
    alone = sx.SubnetDataParallel(make_model(), plan, regime="forward", simulate_rank=1)
    lonely = alone.evaluate(x, modes=("subnetwork",), loss_fn=F.cross_entropy, targets=y)["loss"]["subnetworks"]
    with torch.no_grad():
        own = F.cross_entropy(reference_subnetwork(make_model(), plan, 1).eval()(x), y).item()
    out["simulated"] = (torch.isnan(lonely[0]).item(), abs(lonely[1].item() - own))
    out["errors"] = {
        "targets_without_loss": value_error(lambda: sdp.evaluate(x, targets=y)),
        "non_scalar_loss": value_error(lambda: sdp.evaluate(
            x, loss_fn=lambda o, t: F.cross_entropy(o, t, reduction="none"), targets=y)),
        "bad_mode": value_error(lambda: sdp.evaluate(x, modes=("full", "average"))),
    }
    return out


def _worker(rank, world):
    out = {name: _case(rank, world, name) for name in cases()}
    out["tensor"] = _tensor_and_errors(rank, world)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=400)


@pytest.mark.parametrize("name", ["tuple", "dict", "dataclass", "model_output"])
def test_outputs_match_the_references(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["subnetworks_differ"], (rank, name)  # otherwise "full" and the subnetworks could be confused
        assert r["keys"] == (["ensemble", "full", "subnetwork"], ["ensemble", "full", "loss", "subnetwork"],
                             ["ensemble", "full", "subnetworks"]), r["keys"]
        assert len(set(r["types"])) == 1, r["types"]  # every mode keeps the model's output type
        for mode in ("full", "ensemble", "subnetwork"):
            assert max(r[mode]) <= TOL, (rank, name, mode, r[mode])
        assert r["passthrough"], (rank, name)


@pytest.mark.parametrize("name", ["tuple", "dict", "dataclass", "model_output"])
def test_losses_match_the_references(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        shape, subnetworks = r["loss_subnetworks"]
        assert tuple(shape) == (2,), shape  # every rank sees both ranks' subnetwork losses
        assert subnetworks <= TOL and r["loss_full"] <= TOL and r["loss_ensemble"] <= TOL, (rank, name, r)


def test_tensor_outputs_keep_the_old_call(results):
    for res in results:
        r = res["tensor"]
        assert r["old_keys"] == ["ensemble", "full"] and r["old_full"] <= TOL, r
        assert r["simulated"][0] and r["simulated"][1] <= TOL, r["simulated"]  # only its own rank is known


@pytest.mark.parametrize("case, text", [
    ("targets_without_loss", "give a loss_fn too"),
    ("non_scalar_loss", "must return a scalar"),
    ("bad_mode", "'average'"),
])
def test_bad_requests_are_named(results, case, text):
    for res in results:
        message = res["tensor"]["errors"][case]
        assert message is not None and text in message, message
