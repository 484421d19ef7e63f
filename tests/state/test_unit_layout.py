"""RankLayout in one process (simulate_rank, no process group): where each piece lives on
a rank, reads and writes through it, and lookups that change nothing.

Reference: the model's values before wrapping, cut with the plan's own rectangles
(planning/pieces.full_rectangle) and the rank's parameters as tests/rank_views.py derives
them from the plan and the parameter names, not from the layout."""
import copy

import pytest
import torch

import subnet_ext as sx
from rank_views import local_views
from sdp_helpers import make_model
from subnet_ext.ops.reference import as_2d
from subnet_ext.planning.pieces import full_rectangle, global_pieces

WORLD = 4
CASES = [("block", "forward"), ("neuron", "forward"), ("block", "backward"), ("neuron", "backward")]


def wrapped(level, regime, rank, coverage=0.5):
    """(original state dict, plan, engine simulating `rank`)."""
    model = make_model()
    original = {n: t.detach().clone() for n, t in model.state_dict().items()}
    plan = sx.plan_subnetworks(copy.deepcopy(model), WORLD, coverage, level)
    return original, plan, sx.SubnetDataParallel(model, plan, regime=regime, simulate_rank=rank)


def rect_of(full, rect):
    r0, r1, c0, c1 = rect
    return as_2d(full)[r0:r1, c0:c1]


@pytest.mark.parametrize("level,regime", CASES)
@pytest.mark.parametrize("rank", [0, 3])
def test_held_values_are_the_original_pieces(level, regime, rank):
    original, plan, sdp = wrapped(level, regime, rank)
    layout = sdp.layout
    held = layout.held_values()
    pieces = global_pieces(plan)
    # Forward regime: only the owned pieces are materialised; backward: every rank keeps full copies.
    expected = [p for p in pieces if regime == "backward" or rank in p.owners]
    assert [h.piece for h in held] == expected
    for h in held:
        assert h.full == full_rectangle(plan, h.piece)
        assert torch.equal(h.read(), rect_of(original[h.piece.name], h.full)), h.piece


@pytest.mark.parametrize("level,regime", CASES)
def test_parameter_place_addresses_the_piece_in_the_trained_parameter(level, regime):
    rank = 1
    original, plan, sdp = wrapped(level, regime, rank)
    layout, trained = sdp.layout, {id(p) for p in sdp.parameters()}
    views = {id(param): (name, view) for param, name, view in local_views(plan, rank, sdp.module)}
    owned = [p for p in global_pieces(plan) if p.is_param and rank in p.owners]
    assert owned
    for piece in owned:
        param, rect = layout.parameter_place(piece)
        assert id(param) in trained, piece  # what the optimizer holds, and what gets the gradient
        name, view = views[id(param)]
        assert name == piece.name
        # The rectangle picks exactly the piece's values out of the parameter (distinct random floats).
        assert torch.equal(rect_of(param.detach(), rect), rect_of(original[name], full_rectangle(plan, piece)))
        assert torch.equal(param.detach(), view(original[name]))


def snapshot(sdp):
    return {n: (id(p), p.grad is None, p.detach().clone()) for n, p in sdp.module.named_parameters()}, \
        {n: b.detach().clone() for n, b in sdp.module.named_buffers()}


@pytest.mark.parametrize("level,regime", CASES)
def test_lookups_create_and_change_nothing(level, regime):
    _, plan, sdp = wrapped(level, regime, 2)
    layout = sdp.layout
    params, buffers = snapshot(sdp)
    assert all(no_grad for _, no_grad, _ in params.values())
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    for piece in layout.pieces:
        layout.holds_whole(piece.name)
        if piece in layout.local_start:
            layout.value_place(piece)
        if piece.is_param and layout.owns(piece):
            layout.parameter_place(piece)
    layout.held_values()
    layout.held_optimizer_pieces(opt)
    places = layout.averaging_places()
    assert layout.held_gradients() == []  # no parameter has a gradient: none is made
    layout.local_tensors()
    after_params, after_buffers = snapshot(sdp)
    assert after_params.keys() == params.keys() and after_buffers.keys() == buffers.keys()
    for n, (ident, no_grad, value) in params.items():
        assert after_params[n][0] == ident and after_params[n][1], n  # same Parameter, still no .grad
        assert torch.equal(after_params[n][2], value), n
    assert all(torch.equal(after_buffers[n], b) for n, b in buffers.items())
    assert all(place.param is None or place.param.grad is None for place in places.values())


@pytest.mark.parametrize("level,regime", CASES)
def test_held_pieces_write_into_and_read_from_full_tensors(level, regime):
    _, plan, sdp = wrapped(level, regime, 3)
    layout = sdp.layout
    g = torch.Generator().manual_seed(5)
    new = {n: torch.randn(shape, generator=g) for n, shape in plan.tensor_shapes.items() if plan.is_float(n)}
    for h in layout.held_values():
        h.read_from_full(new[h.piece.name])
    for param, name, view in local_views(plan, 3, sdp.module):
        if regime == "forward" or param.requires_grad:
            assert torch.equal(param.detach(), view(new[name])), name
    for h in layout.held_values():
        target = torch.zeros(plan.tensor_shapes[h.piece.name])
        h.write_into_full(target)
        expected = torch.zeros_like(target)
        rect_of(expected, h.full).copy_(rect_of(new[h.piece.name], h.full))
        assert torch.equal(target, expected), h.piece


def test_value_of_names_what_is_not_held():
    _, plan, sdp = wrapped("block", "forward", 0)
    layout = sdp.layout
    skipped = [p.name for p in layout.pieces if 0 not in p.owners]
    assert skipped
    for name in skipped:
        assert not layout.holds_whole(name)
        with pytest.raises((AttributeError, KeyError)):
            layout.value_of(name)


def test_the_engine_hands_out_its_parts_read_only():
    """`layout` and the other parts are the engine's own objects, and cannot be replaced from outside."""
    _, _, sdp = wrapped("neuron", "backward", 1)
    assert [id(p) for p in sdp.layout.trainable] == [id(p) for p in sdp.parameters()]
    assert sdp.refresh is not None and sdp.shared_shards is None and sdp.communicator.groups is not None
    for part in ("layout", "communicator", "averager", "refresh", "shared_shards", "call_ledger"):
        with pytest.raises(AttributeError):
            setattr(sdp, part, None)
