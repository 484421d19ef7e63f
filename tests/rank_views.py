"""A rank's local parameters in terms of the full model's tensors, derived from the plan's
pieces and the parameters' names alone: a reference independent of the engine's
RankLayout, for the single-process unit tests of the layout, the averager and the
optimizer-state mapping."""
import re

import torch

from subnet_ext.planning.pieces import global_pieces, owned_indices


def local_views(plan, rank: int, module) -> list:
    """[(local parameter, full name, view)] for every parameter of `module` (the model after
    the engine's surgery for `rank`): view(full) takes the part of a full-shape tensor that
    the local parameter holds, in its local order and shape.

    Forward regime: a compact tensor holds the owned rows/columns in global order
    (planning's owned_indices); backward regime, neuron level: `<leaf>_owned<i>` is the
    i-th owned piece of `<leaf>`; anything else holds its whole tensor."""
    pieces = global_pieces(plan)
    out = []
    for local_name, param in module.named_parameters():
        path, _, leaf = local_name.rpartition(".")
        owned = re.fullmatch(r"(.+)_owned(\d+)", leaf)
        if owned:
            name = f"{path}.{owned.group(1)}" if path else owned.group(1)
            p = [q for q in pieces if q.name == name and rank in q.owners][int(owned.group(2))]
            out.append((param, name, lambda full, p=p: full.narrow(p.dim, p.start, p.length)))
        elif tuple(param.shape) != tuple(plan.tensor_shapes[local_name]):
            dim, idx = owned_indices(pieces, rank, local_name)
            out.append((param, local_name, lambda full, dim=dim, idx=idx: full.index_select(dim, idx)))
        else:
            out.append((param, local_name, lambda full: full))
    return out


def owners_mean(plan, per_rank: list) -> dict:
    """{name: full tensor} whose every element is the mean, over the owners of its piece, of
    the ranks' full tensors per_rank[q][name] (what averaging among owners gives)."""
    out = {n: torch.zeros_like(t) for n, t in per_rank[0].items()}
    for p in global_pieces(plan):
        if p.name not in out:
            continue
        parts = [per_rank[q][p.name] for q in p.owners]
        if out[p.name].dim() == 0:
            out[p.name] = torch.stack(parts).mean(0)
            continue
        out[p.name].narrow(p.dim, p.start, p.length).copy_(
            torch.stack([t.narrow(p.dim, p.start, p.length) for t in parts]).mean(0))
    return out


def to_full(plan, rank: int, module, tensor_of) -> dict:
    """{full name: full-shape float32 tensor}: tensor_of(local parameter) (a tensor of the
    parameter's local shape, or None) placed where local_views says the parameter's elements
    come from, NaN elsewhere. The inverse of local_views, for gathering ranks' local
    gradients into full-model coordinates."""
    out = {}
    for param, name, view in local_views(plan, rank, module):
        value = tensor_of(param)
        if value is None:
            continue
        full = out.setdefault(name, torch.full(plan.tensor_shapes[name], float("nan")))
        where = view(torch.arange(full.numel()).view(full.shape))  # the full positions of the local elements
        full.view(-1)[where.reshape(-1)] = value.detach().float().reshape(-1)
    return out
