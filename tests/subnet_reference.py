"""One-process references for the forward regime, built without the engine's surgery.

A rank's subnetwork is emulated on the *full* model: a skipped block is replaced by a
function the test writes itself (the shortcut, with or without ReLU, or the identity),
and a neuron/head the rank does not own is removed by zeroing its features at the input
of the layer that consumes them (heads and neurons are independent, so this computes the
same outputs and the same gradients on the owned slices as the compact subnetwork).
One SGD step of the engine must then equal theta - lr * (owner mean of these gradients).
"""
import copy
import inspect

import torch
import torch.nn as nn


class _Replacement(nn.Module):
    def __init__(self, block, fn):
        super().__init__()
        self.block, self.fn = block, fn

    def __getattr__(self, name):  # nn.TransformerEncoder reads layers[0].self_attn.batch_first
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)

    def forward(self, *args, **kwargs):  # the input by position, or by the block's first parameter's name
        x = args[0] if args else kwargs[next(iter(inspect.signature(self.block.forward).parameters))]
        return self.fn(self.block, x)


def reference_subnetwork(model, plan, rank, skip_fns=None, consumer_widths=None):
    """Deep copy of `model` computing rank's subnetwork.

    skip_fns: {block path: fn(block, x [B, ...]) -> skip output} for block plans
        (default: identity).
    consumer_widths: {group path: (consumer module path, unit width[, 1 for a conv's
        channel dim])} for neuron plans; the consumer's input features (last dim, or dim 1)
        of units the rank does not own are zeroed.
    """
    ref = copy.deepcopy(model)
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        owned = plan.owners[rank, a:b]
        if g.kind == "block":
            if not bool(owned[0]):
                parent_path, _, leaf = g.path.rpartition(".")
                parent = ref.get_submodule(parent_path)
                fn = (skip_fns or {}).get(g.path, lambda block, x: x)
                setattr(parent, leaf, _Replacement(getattr(parent, leaf), fn))
            continue
        consumer, width, *dim = consumer_widths[g.path]
        keep = owned.repeat_interleave(width).to(torch.float32)
        if dim and dim[0] == 1:  # channels of a conv input [B, C, H, W]
            keep = keep.view(-1, 1, 1)
        ref.get_submodule(consumer).register_forward_pre_hook(
            lambda m, args, keep=keep: (args[0] * keep.to(args[0].dtype),) + tuple(args[1:]))
    return ref


def expected_sgd_step(model, plan, refs, loss_of, lr):
    """{param name: expected value after one SGD step}: theta - lr * mean over the owners
    of each element of the reference gradients. refs[k]: rank k's reference subnetwork;
    loss_of(module, k) -> scalar loss on rank k's batch."""
    grads = []
    for k, ref in enumerate(refs):
        ref.zero_grad()
        loss_of(ref, k).backward()
        grads.append({n: (p.grad if p.grad is not None else torch.zeros_like(p))
                      for n, p in ref.named_parameters()})
    names = [n for n, _ in model.named_parameters()]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    count = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for k in range(len(refs)):
        owns = ownership_masks(model, plan, k)
        for n in names:
            total[n] += owns[n] * _unwrap(grads[k], n)
            count[n] += owns[n]
    params = dict(model.named_parameters())
    return {n: params[n].detach() - lr * total[n] / count[n] for n in names}


def _unwrap(grads, name):
    """A reference wraps skipped blocks (`path.block.x`); map the original name to it."""
    if name in grads:
        return grads[name]
    for n, g in grads.items():
        if n.replace(".block.", ".") == name:
            return g
    raise KeyError(name)


def ownership_masks(model, plan, rank):
    """{param name: 0/1 tensor of its shape}: which elements `rank` holds, from the plan's
    owner matrix and member layout (shared parameters: all ones)."""
    out = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    for g, (a, b) in zip(plan.groups, plan.unit_ranges):
        owned = plan.owners[rank, a:b]
        if g.kind == "block":
            for n in g.params:
                out[n] = out[n] * float(owned[0])
            continue
        for m in g.members:
            if m.name not in out:
                continue
            t = out[m.name]
            for j in range(g.size):
                if not bool(owned[j]):
                    t.narrow(m.dim, m.offset + j * m.width, m.width).zero_()
    return out


def max_diff(a: dict, b: dict) -> float:
    """Largest |a[n] - b[n]| over the names of b."""
    return max((a[n].float() - b[n].float()).abs().max().item() for n in b)


def to_numpy(obj):
    """Tensors -> numpy arrays, recursively: a worker's result crosses the process boundary
    by value (torch's shared-memory handles die with the worker)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def from_numpy(obj):
    """Inverse of to_numpy."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: from_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_numpy(v) for v in obj)
    return obj
