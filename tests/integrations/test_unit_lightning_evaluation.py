"""What a LightningModule's evaluation steps run on (integrations/lightning_evaluation.py), in one
process, on a module written as a LightningModule holds its model (a child `net` and a tensor of
its own), without Lightning:

- "full" while fitting (a 1-rank engine wraps the module): inside a step the module's child and
  own tensor are the full model's, and its call equals the full model's; after the step every
  module object is as it was (the engine's stand-ins back in place), nothing set on it;
- "ensemble" outside fit (the plain module, a 2-rank plan): inside a step `module(x)` is the
  mean of the 2 ranks' subnetworks computed here by hand (subnet_reference.py: the skipped
  blocks' outputs replaced by their input), with no instance `forward` on the module; after the
  step the module is as it was and computes as before.
"""
import warnings

import torch
import torch.nn as nn

import subnet_ext as sx
from module_objects import differences, objects
from sdp_helpers import make_model
from subnet_ext.integrations.lightning_evaluation import EvaluatedModel
from subnet_reference import reference_subnetwork


class Lit(nn.Module):
    """x [B, 12] -> logits [B, classes] + an offset the module holds itself (shared by every rank)."""

    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.offset = nn.Parameter(torch.linspace(-1, 1, self.net.head.out_features))

    def forward(self, x):
        return self.net(x) + self.offset


def _quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small plans' coverage warnings
        return fn(*args, **kwargs)


def test_full_evaluation_swaps_the_full_model_in_for_the_step_only():
    module = Lit()
    plan = _quietly(sx.plan_subnetworks, module, 1, 1.0, "neuron")
    engine = sx.SubnetDataParallel(module, plan)
    wrapped = objects(module)
    evaluated = EvaluatedModel(module, engine, plan, engine.config, "full")
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    with evaluated.inside(), torch.no_grad():
        assert module.net is evaluated.full.net and module.offset is evaluated.full.offset
        assert "forward" not in vars(module)
        torch.testing.assert_close(module(x), evaluated.full(x), rtol=0, atol=0)
    assert differences(wrapped, objects(module)) == []


def test_ensemble_evaluation_is_the_mean_of_the_subnetworks_without_patching_forward():
    module = Lit()
    plan = _quietly(sx.plan_subnetworks, module, 2, 0.5, "block")
    before = objects(module)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = module(x)
        want = torch.stack([reference_subnetwork(module, plan, k)(x) for k in range(2)]).mean(0)
    evaluated = _quietly(EvaluatedModel, module, None, plan, sx.SDPConfig(), "ensemble")
    with evaluated.inside(), torch.no_grad():
        assert "forward" not in vars(module)
        got = module(x)
    assert not torch.allclose(want, plain)  # the ensemble is not the full model
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert differences(before, objects(module)) == []
    with torch.no_grad():
        torch.testing.assert_close(module(x), plain, rtol=0, atol=0)
