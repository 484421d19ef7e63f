"""The block assignment option (plan_subnetworks(block_assignment=...)): "contiguous" gives each rank
runs of neighbouring blocks, "balanced" (the default, once called "rolling") stays what it was; block_pairs_covered counts
what a plan trains together. Every count here is made by this file from the owner matrix."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import subnet_ext as sx
from subnet_ext.models.gpt import GPT, GPT_PRESETS
from subnet_ext.planning.assignment.assign import assign_blocks, block_pairs_covered


def _held(owners):
    return [[u for u in range(owners.shape[1]) if owners[q, u]] for q in range(owners.shape[0])]


def _count(owners):
    """(adjacent pairs some rank holds together, pairs some rank holds together), counted pair by pair."""
    held = [set(h) for h in _held(owners)]
    n = owners.shape[1]
    together = lambda u, v: any(u in h and v in h for h in held)  # noqa: E731
    return (sum(together(u, u + 1) for u in range(n - 1)),
            sum(together(u, v) for u, v in itertools.combinations(range(n), 2)))


def _cyclic_runs(blocks, n):
    """How many runs of consecutive blocks (cyclically: n-1 then 0 counts as neighbours) `blocks` forms."""
    s = set(blocks)
    return 1 if len(s) == n else sum(1 for u in s if (u - 1) % n not in s)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 24), k=st.integers(1, 8), r=st.integers(1, 8))
def test_contiguous_blocks_are_runs_of_neighbours(n, k, r):
    r = min(r, k)
    owners = assign_blocks(torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64), k, r, "contiguous")
    assert torch.equal(owners.sum(0), torch.full((n,), r))  # every block has r owners
    for blocks in _held(owners):
        if n >= k and blocks:
            assert _cyclic_runs(blocks, n) == 1, blocks  # one cyclic run of neighbouring blocks per rank
            assert n * r // k <= len(blocks) <= -(-n * r // k)


def test_sixteen_blocks_at_four_ranks_half_coverage():
    """The study's case: 8 blocks per rank; contiguous trains every adjacent pair together, rolling fewer."""
    ones = torch.ones(16, dtype=torch.float64)
    contiguous = assign_blocks(ones, ones, 4, 2, "contiguous")
    rolling = assign_blocks(ones, ones, 4, 2)
    assert _held(contiguous)[0] == list(range(8))
    assert [len(h) for h in _held(contiguous)] == [8] * 4 and [len(h) for h in _held(rolling)] == [8] * 4
    assert _count(contiguous) == (15, 88)
    assert _count(rolling)[0] < 15
    for owners in (contiguous, rolling):
        cover = block_pairs_covered(owners)
        assert (cover["adjacent"], cover["pairs"]) == _count(owners)
        assert (cover["adjacent_total"], cover["pairs_total"]) == (15, 120)
        assert cover["per_rank"] == _held(owners)


def test_the_planner_offers_it_and_the_default_is_balanced():
    model = GPT(GPT_PRESETS["deep"])
    default = sx.plan_subnetworks(model, 4, 0.5, "block")
    contiguous = sx.plan_subnetworks(model, 4, 0.5, "block", block_assignment="contiguous")
    ones = torch.ones(16, dtype=torch.float64)
    assert torch.equal(default.owners, assign_blocks(ones, ones, 4, 2))
    assert torch.equal(contiguous.owners, assign_blocks(ones, ones, 4, 2, "contiguous"))
    assert _count(contiguous.owners) == (15, 88)
    contiguous.check()  # full coverage, connected rank graph
    with pytest.raises(ValueError, match="block_assignment must be one of balanced, contiguous"):
        sx.plan_subnetworks(model, 4, 0.5, "block", block_assignment="pairs")
    with pytest.raises(ValueError, match="now called 'balanced'"):  # the schedule is SDPConfig(assignment="rolling")
        sx.plan_subnetworks(model, 4, 0.5, "block", block_assignment="rolling")
