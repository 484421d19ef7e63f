"""One-process references of SDP's updates, computed from plain full models (no engine
code): each rank's gradient comes from its own copy of the unmasked model."""
import copy

import torch


def narrow(t: torch.Tensor, piece) -> torch.Tensor:
    """The piece's slice of a full tensor (0-dim tensors are whole)."""
    return t.narrow(piece.dim, piece.start, piece.length) if t.dim() else t


def full_gradients(model, state, loss_of):
    """{name: gradient} of loss_of(model copy) with the copy holding `state`."""
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    loss_of(m).backward()
    return {n: p.grad for n, p in m.named_parameters()}


def backward_regime_sgd(model, pieces, world, loss_of, steps, lr, sync_every=1):
    """The backward regime with SGD(lr), as local SGD within owner groups.

    Each rank q holds full parameters; its gradient is the full model's on its batch
    (loss_of(model, q, step)). sync_every=1: every owner of a piece applies the owner-mean
    gradient (and the other ranks get that value). H > 1: owners apply their own gradient;
    copies of pieces a rank does not own keep their last value; every H steps each piece
    becomes the owner mean of its owners' values on every rank.

    Returns [per step: [per rank: state dict after that step]].
    """
    states = [copy.deepcopy(model.state_dict()) for _ in range(world)]
    history = []
    for step in range(steps):
        grads = [full_gradients(model, states[q], lambda m, q=q: loss_of(m, q, step)) for q in range(world)]
        for p in pieces:
            if not p.is_param:
                continue
            if sync_every == 1:
                g = torch.stack([narrow(grads[q][p.name], p) for q in p.owners]).mean(0)
                new = narrow(states[p.owners[0]][p.name], p) - lr * g
                for q in range(world):
                    narrow(states[q][p.name], p).copy_(new)
            else:
                for q in p.owners:
                    narrow(states[q][p.name], p).sub_(lr * narrow(grads[q][p.name], p))
        if sync_every > 1 and (step + 1) % sync_every == 0:
            for p in pieces:
                if p.is_param:
                    mean = torch.stack([narrow(states[q][p.name], p) for q in p.owners]).mean(0)
                    for q in range(world):
                        narrow(states[q][p.name], p).copy_(mean)
        history.append([copy.deepcopy(s) for s in states])
    return history


def max_param_diff(state, reference, names) -> float:
    """Largest |state - reference| over the given entries."""
    return max((state[n].float() - reference[n].float()).abs().max().item() for n in names)
