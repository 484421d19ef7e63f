"""Fuzzing of every input a user or a file can hand us (hypothesis): plan JSON, CLI
arguments, masked-linear indices and packed-segment rectangles. The contract: a clear
ValueError/RuntimeError (or argparse's exit 2), or exactly the reference result — never
another exception, a crash, a hang or a silently wrong answer.

Example counts are modest so the file runs in well under 30 s on 2 cores.
"""
import contextlib
import io
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import subnet_ext as sx
from subnet_ext import reference
from subnet_ext.models import ResidualMLP
from subnet_ext.planning.pieces import global_pieces
from subnet_ext.planning.pieces import full_rectangle
from subnet_ext.state.held_pieces import area
from subnet_ext.cli.train import build_parser, check_args

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLEAR = (ValueError, RuntimeError)

# ----------------------------------------------------------------------------- plan JSON
_MODEL = ResidualMLP(in_features=6, num_classes=3, width=8, depth=2, hidden=8)
PLANS = [sx.plan_subnetworks(_MODEL, 3, 0.5, level).to_json() for level in ("block", "neuron")]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


def _paths(obj, prefix=()):
    """Every (key path) inside a parsed JSON value."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate(obj, path, action, value):
    if not path:
        return value
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == "delete":
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return obj


def _assert_usable(plan):
    """A plan that parsed must be internally consistent: its pieces tile every float tensor."""
    plan.check()
    tiled = {}
    for p in global_pieces(plan):
        tiled[p.name] = tiled.get(p.name, 0) + area(full_rectangle(plan, p))
    for name, shape in plan.tensor_shapes.items():
        if plan.is_float(name):
            assert tiled.get(name) == math.prod(shape), (name, shape, tiled.get(name))
    assert sx.SubnetPlan.from_json(plan.to_json()).to_json() == plan.to_json()


@FUZZ
@given(which=st.sampled_from(PLANS), data=st.data(), action=st.sampled_from(["set", "delete"]), value=json_values)
def test_plan_json_structural_mutations(which, data, action, value):
    doc = json.loads(which)
    path = data.draw(st.sampled_from(list(_paths(doc))))
    _parse_or_check_usable(json.dumps(_mutate(doc, path, action, value)))


@FUZZ
@given(which=st.sampled_from(PLANS), cut=st.integers(0, 10**6), junk=st.text(max_size=6), how=st.integers(0, 2))
@example(which=PLANS[0], cut=0, junk="[" * 5000, how=2)  # nesting deep enough for RecursionError
def test_plan_json_text_mutations(which, cut, junk, how):
    cut %= len(which) + 1
    _parse_or_check_usable([which[:cut], which[:cut] + junk + which[cut + 1:], junk][how])


def _parse_or_check_usable(text):
    """A clear ValueError, or a plan that is whole and usable."""
    try:
        plan = sx.SubnetPlan.from_json(text)
    except ValueError:
        event("clear error")
        return
    event("parsed, checked usable")
    _assert_usable(plan)


def test_plan_json_silent_errors_are_caught():
    doc = json.loads(PLANS[1])
    doc["owners"][0][0] = 0.5  # would become 0 in a uint8 tensor
    with pytest.raises(ValueError, match="only 0 and 1"):
        sx.SubnetPlan.from_json(json.dumps(doc))
    doc = json.loads(PLANS[1])
    name = next(iter(doc["tensor_shapes"]))
    doc["tensor_shapes"][name][0] += 1  # the fingerprint no longer describes the shapes
    with pytest.raises(ValueError, match="fingerprint"):
        sx.SubnetPlan.from_json(json.dumps(doc))
    doc = json.loads(PLANS[1])
    doc["groups"][0]["members"][0]["width"] = 2  # units no longer tile the tensor
    with pytest.raises(ValueError, match="do not tile"):
        sx.SubnetPlan.from_json(json.dumps(doc))


# ----------------------------------------------------------------------------- CLI arguments
ACTIONS = [a for a in build_parser()._actions if a.option_strings]
BAD_VALUES = st.one_of(
    st.integers(-2**70, 2**70).map(str),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "-0.0", "1e-9", "", " ", "--", "-1", "auto", "latest",
                     "cifar:/nonexistent", "tokens:/nonexistent.bin", "/nonexistent/dir", "/tmp", "134m"]),
    st.text(max_size=6))


def _good_value(action):
    if action.choices:
        return st.sampled_from(list(action.choices))
    if action.type is int:
        return st.integers(-1, 8).map(str)
    if action.type is float:
        return st.sampled_from(["0.25", "0.5", "1.0", "3e-3", "60"])
    return st.sampled_from(["digits", "synthetic", "tiny", "latest", "auto"])


@st.composite
def cli_argv(draw):
    """Options with values that are mostly plausible and sometimes hostile, or raw tokens."""
    argv = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 9)) == 0:
            argv.append(draw(BAD_VALUES))  # a stray token
            continue
        action = draw(st.sampled_from(ACTIONS))
        argv.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            argv.append(draw(_good_value(action) if draw(st.integers(0, 3)) else BAD_VALUES))
    return argv


@FUZZ
@given(argv=cli_argv())
def test_cli_arguments_parse_or_exit_cleanly(argv):
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
            check_args(parser, args)
    except SystemExit as e:
        assert e.code == 0 or (e.code == 2 and "error:" in err.getvalue())  # --help, or a usage error
        event("usage error" if e.code else "help")
        return
    event("accepted")
    # Accepted: every value is one the run can use.
    assert 0 < args.coverage <= 1 and args.steps >= 1 and args.batch_size >= 1 and args.sync_every >= 1
    assert math.isfinite(args.lr) and args.lr > 0 and math.isfinite(args.timeout) and args.timeout > 0
    assert args.keep_last >= 1 and args.verify_every >= 0 and (args.max_skipped is None or args.max_skipped >= 0)
    assert args.width is None or args.width >= 1
    assert args.resume is None or args.save_dir or args.resume not in ("latest", "auto")


# ----------------------------------------------------------------------------- masked linear
def _index(draw, bound):
    kind = draw(st.sampled_from(["none", "good", "good", "raw", "int32", "float", "2d"]))
    if kind == "none":
        return None
    if kind == "good":
        return torch.tensor(draw(st.permutations(list(range(bound))))[:draw(st.integers(0, bound))],
                            dtype=torch.int64)
    values = draw(st.lists(st.integers(-3, bound + 3), max_size=6))
    t = torch.tensor(values, dtype={"raw": torch.int64, "int32": torch.int32, "float": torch.float32,
                                    "2d": torch.int64}[kind])
    return t.reshape(1, -1) if kind == "2d" else t


@st.composite
def linear_case(draw):
    o, i, n = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(0, 3))
    out_idx, in_idx = _index(draw, o), _index(draw, i)
    compact = draw(st.booleans())
    kept_o = o if out_idx is None else len(out_idx.reshape(-1))
    kept_i = i if in_idx is None else len(in_idx.reshape(-1))
    w_shape = (kept_o, kept_i) if compact and draw(st.booleans()) else (o, i)
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    x = torch.randn(n, i if not draw(st.booleans()) else draw(st.integers(1, 6)), generator=g, dtype=torch.float64)
    weight = torch.randn(*w_shape, generator=g, dtype=torch.float64)
    bias = torch.randn(w_shape[0], generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    scatter = draw(st.sampled_from([None, None, o, o - 1, 0]))
    return x, weight, bias, out_idx, in_idx, compact, scatter


@FUZZ
@given(case=linear_case())
def test_masked_linear_error_or_reference(case):
    x, weight, bias, out_idx, in_idx, compact, scatter = case
    try:
        y = sx.masked_linear(x, weight, bias, out_idx, in_idx, compact_weight=compact, scatter_width=scatter)
    except CLEAR:
        event("clear error")
        return
    event("checked against the reference")
    expected = reference.masked_linear(x, weight, bias, out_idx, in_idx, compact_weight=compact,
                                       scatter_width=scatter)
    torch.testing.assert_close(y, expected)


@FUZZ
@given(case=linear_case(), mask=st.tuples(st.booleans(), st.booleans(), st.booleans()), full=st.booleans())
def test_masked_linear_backward_error_or_reference(case, mask, full):
    x, weight, _, out_idx, in_idx, compact, _ = case
    width = weight.shape[0] if (compact or out_idx is None) else len(out_idx.reshape(-1))
    grad_out = torch.randn(x.shape[0], weight.shape[0] if full else width, dtype=torch.float64)
    kw = dict(compact_weight=compact, grad_out_full=full, output_mask=mask)
    try:
        got = sx.masked_linear_backward(grad_out, x, weight, out_idx, in_idx, **kw)
    except CLEAR:
        event("clear error")
        return
    event("checked against the reference")
    expected = reference.masked_linear_backward(grad_out, x, weight, out_idx, in_idx, **kw)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- packed segments
@st.composite
def segment_case(draw):
    shapes = draw(st.lists(st.sampled_from([(), (3,), (4, 2), (2, 3, 2), (0, 3)]), min_size=1, max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    tensors = [torch.randn(s, generator=g) for s in shapes]
    rows = []
    offset = 0
    for _ in range(draw(st.integers(0, 4))):
        t = draw(st.integers(-1, len(tensors)))
        r0, c0 = draw(st.integers(-1, 4)), draw(st.integers(-1, 6))
        r1, c1 = r0 + draw(st.integers(-1, 3)), c0 + draw(st.integers(-1, 3))
        off = draw(st.sampled_from([offset, offset, 0, offset + 1, -1, 2**63 - 2]))
        rows.append((t, r0, r1, c0, c1, off))
        offset = off + max(0, r1 - r0) * max(0, c1 - c0) if 0 <= off < 2**40 else offset
    table = torch.tensor(rows, dtype=torch.int64) if rows else torch.empty(0, 6, dtype=torch.int64)
    if draw(st.booleans()):
        table = table[:, :draw(st.integers(0, 5))]  # a malformed table
    buffer = torch.randn(draw(st.integers(0, 40)), generator=g)
    scales = [draw(st.sampled_from([0.5, 1.0, 1 / 3, float("nan")])) for _ in range(len(rows))]
    return tensors, table, buffer, scales


@FUZZ
@given(case=segment_case())
@example(case=([torch.zeros(4, 4)], torch.tensor([[0, 0, 1, 0, 4, 2**63 - 2]]), torch.zeros(8), [1.0]))
def test_pack_segments_error_or_reference(case):
    tensors, table, buffer, _ = case
    got = buffer.clone()
    try:
        sx.pack_segments(tensors, table, got)
    except CLEAR:
        event("clear error")
        return
    event("checked against the reference")
    torch.testing.assert_close(got, reference.pack_segments(tensors, table, buffer.clone()))


@FUZZ
@given(case=segment_case())
def test_unpack_average_error_or_reference(case):
    tensors, table, buffer, scales = case
    got = [t.clone() for t in tensors]
    try:
        sx.unpack_average_(got, table, buffer, scales)
    except CLEAR:
        event("clear error")
        return
    event("checked against the reference")
    expected = [t.clone() for t in tensors]
    reference.unpack_average_(expected, table, buffer, scales)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, equal_nan=True)
