"""SubnetDataParallel.close() gives the user's model back as it was before wrapping.

2 gloo ranks; ResidualMLP (block and neuron level) and a tiny LLaMA (neuron level), in
the forward and backward regimes. After 2 steps and close(), the model's structure
(module types, parameters, buffers, hooks, width attributes, instance attributes) must
equal that of a freshly built model, and its values those of full_state_dict() taken
just before close().
"""
import torch
import torch.nn.functional as F

import subnet_ext as sx
from sdp_helpers import batch, make_model, train
from subnet_ext.models import LLAMA_PRESETS, LlamaForCausalLM
from subnet_ext.testing import run_distributed

CASES = [("mlp", "forward", "block"), ("mlp", "backward", "block"), ("mlp", "forward", "neuron"),
         ("mlp", "backward", "neuron"), ("llama", "forward", "neuron"), ("llama", "backward", "neuron")]


def _counting_hook(module, args, output):
    """A user's forward hook: it must survive the wrapping and close()."""
    return output


def build(kind):
    """A fresh model (same weights on every rank), with one user hook on its first child."""
    if kind == "mlp":
        model = make_model()
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LLAMA_PRESETS["tiny"])
    next(iter(model.children())).register_forward_hook(_counting_hook)
    return model


def structure(model):
    """Everything surgery may change, as plain comparable values."""
    out = {"modules": [(n, type(m).__name__) for n, m in model.named_modules()],
           "params": [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()],
           "buffers": [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]}
    for n, m in model.named_modules():
        out[f"hooks:{n}"] = [[type(h).__name__ for h in d.values()]
                             for d in (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks)]
        out[f"instance:{n}"] = sorted(k for k in vars(m) if k == "forward" or k.startswith("_sdp_")
                                      or k in m._parameters)
        out[f"ints:{n}"] = {k: v for k, v in vars(m).items() if type(v) is int}
    return out


def step_batch(kind, rank, step):
    """(input, loss function) of one rank's batch."""
    if kind == "mlp":
        x, y = batch(rank, step)
        return x, lambda out: F.cross_entropy(out, y)
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, LLAMA_PRESETS["tiny"].vocab_size, (2, 8), generator=g)
    return ids, lambda out: F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))


def _worker(rank, world):
    results = []
    for kind, regime, level in CASES:
        fresh, model = build(kind), build(kind)
        sdp = sx.SubnetDataParallel(model, sx.plan_subnetworks(model, world, 0.5, level), regime=regime)
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-2)
        if kind == "mlp":
            train(sdp, opt, rank, 2)
        else:
            for s in range(2):
                x, loss = step_batch(kind, rank, s)
                loss(sdp(x)).backward()
                opt.step()
                opt.zero_grad()
        full = sdp.full_state_dict()
        sdp.close()
        got, want = structure(model), structure(fresh)
        differs = sorted(k for k in want if got.get(k) != want[k]) + sorted(set(got) - set(want))
        state = model.state_dict()
        values_equal = list(state) == list(full) and all(torch.equal(state[n], full[n]) for n in full)
        x, loss = step_batch(kind, rank, 5)
        loss_value = loss(model(x))
        loss_value.backward()
        grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
        try:
            sdp(x)
            refused = ""
        except RuntimeError as e:
            refused = str(e)
        results.append({"case": (kind, regime, level), "differs": differs, "values_equal": values_equal,
                        "loss_finite": bool(torch.isfinite(loss_value)), "grads": grads, "refused": refused})
    return results


def test_close_restores_the_model():
    for rank_results in run_distributed(_worker, 2, timeout=400.0):
        for r in rank_results:
            assert r["differs"] == [], (r["case"], r["differs"])
            assert r["values_equal"], r["case"]
            assert r["loss_finite"] and r["grads"], r["case"]
            assert "closed" in r["refused"], r["case"]
