"""Fuzzing of every input a user or a file can hand us (hypothesis): plan JSON, CLI
arguments and checkpoint manifests here, the ops' indices and rectangles in
tests/ops/test_fuzz_ops.py. The contract: the one error type the surface means to raise (ValueError
from SubnetPlan.from_json; argparse's exit 2; CorruptCheckpoint from read_manifest), or a
value checked usable/exact. Any other exception fails the test.

Each surface counts its outcomes and asserts that a minimum share of the generated
examples reached the check (fuzz_harness.py), so a generator that only ever produces
rejected input fails instead of passing vacuously.

SUBNET_EXT_FUZZ_EXAMPLES sets the examples per surface (default 150, so the files run in
well under a minute on 2 cores); `make fuzz` runs bench/fuzz.py with 10,000.
"""
import contextlib
import io
import json
import math
import os
import tempfile

import pytest
from hypothesis import strategies as st

import subnet_ext as sx
from subnet_ext.models import ResidualMLP
from subnet_ext.planning.pieces import global_pieces
from subnet_ext.planning.pieces import full_rectangle
from subnet_ext.state.layout import area
from subnet_ext.state.checkpoint_store import MANIFEST, CorruptCheckpoint, _body_checksum, read_manifest, write_manifest
from subnet_ext.cli.train import build_parser, check_args
from fuzz_harness import COMPARED, _mutate, _paths, assert_compared, json_values, run_surface

# ----------------------------------------------------------------------------- plan JSON
_MODEL = ResidualMLP(in_features=6, num_classes=3, width=8, depth=2, hidden=8)
PLANS = [sx.plan_subnetworks(_MODEL, 3, 0.5, level).to_json() for level in ("block", "neuron")]
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


def _structural(which, data, action, value):
    doc = json.loads(which)
    path = data.draw(st.sampled_from(list(_paths(doc))))
    return _parse_or_check_usable(json.dumps(doc if action == "keep" else _mutate(doc, path, action, value)))


def fuzz_plan_json_structural():
    """Counter of outcomes: one JSON value of a plan set to random JSON, or deleted."""
    return run_surface(_structural, dict(which=st.sampled_from(PLANS), data=st.data(),
                                         action=st.sampled_from(["set", "delete", "keep"]), value=json_values))


def test_plan_json_structural_mutations():
    # "keep" (an unmutated plan re-serialised) makes sure some examples get past the checks.
    assert_compared(fuzz_plan_json_structural(), 0.1)


def _text(which, cut, junk, how):
    cut %= len(which) + 1
    return _parse_or_check_usable([which, which[:cut], which[:cut] + junk + which[cut + 1:], junk][how])


def fuzz_plan_json_text():
    """Counter of outcomes: a plan's JSON text cut, spliced with junk, or replaced by junk."""
    return run_surface(_text, dict(which=st.sampled_from(PLANS), cut=st.integers(0, 10**6),
                                   junk=st.text(max_size=6), how=st.integers(0, 3)),
                       # nesting deep enough for RecursionError
                       examples=[dict(which=PLANS[0], cut=0, junk="[" * 5000, how=3)])


def test_plan_json_text_mutations():
    assert_compared(fuzz_plan_json_text(), 0.1)


def _parse_or_check_usable(text):
    """A clear ValueError, or a plan that is whole and usable."""
    try:
        plan = sx.SubnetPlan.from_json(text)
    except ValueError:
        return "clear error"
    _assert_usable(plan)
    return COMPARED


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
    with pytest.raises(ValueError, match="do not (tile|fit)"):
        sx.SubnetPlan.from_json(json.dumps(doc))


# ----------------------------------------------------------------------------- CLI arguments
# --help (exit 0) is left out: drawn among 6 options it would end most examples before check_args.
ACTIONS = [a for a in build_parser()._actions if a.option_strings and "--help" not in a.option_strings]
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
    """Options with values that are mostly plausible and sometimes hostile, or raw tokens. The odds
    (a stray token 1 in 20, a hostile value 1 in 6) leave about a quarter of the argv lists valid,
    so test_cli_arguments_parse_or_exit_cleanly's 10% is far from its expected count."""
    argv = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 19)) == 0:
            argv.append(draw(BAD_VALUES))  # a stray token
            continue
        action = draw(st.sampled_from(ACTIONS))
        argv.append(draw(st.sampled_from(action.option_strings)))
        if action.nargs != 0:
            argv.append(draw(_good_value(action) if draw(st.integers(0, 5)) else BAD_VALUES))
    return argv


def _cli(argv):
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
            check_args(parser, args)
    except SystemExit as e:
        assert e.code == 0 or (e.code == 2 and "error:" in err.getvalue())  # --help, or a usage error
        return "usage error" if e.code else "help"
    # Accepted: every value is one the run can use.
    assert 0 < args.coverage <= 1 and args.steps >= 1 and args.batch_size >= 1 and args.sync_every >= 1
    assert math.isfinite(args.lr) and args.lr > 0 and math.isfinite(args.timeout) and args.timeout > 0
    assert args.keep_last >= 1 and args.verify_every >= 0 and (args.max_skipped is None or args.max_skipped >= 0)
    assert args.width is None or args.width >= 1
    assert args.resume is None or args.save_dir or args.resume not in ("latest", "auto")
    return COMPARED


def fuzz_cli():
    """Counter of outcomes: argv lists of plausible and hostile options."""
    return run_surface(_cli, dict(argv=cli_argv()))


def test_cli_arguments_parse_or_exit_cleanly():
    assert_compared(fuzz_cli(), 0.1)

# ----------------------------------------------------------------------------- checkpoint manifests
_BODY = {"step": 7, "world_size": 2, "files": {"model.pt": {"bytes": 1234, "sha256": "ab" * 32},
                                                 "rank-1/optim.pt": {"bytes": 0, "sha256": "cd" * 32}}}


def _valid_manifest_text():
    with tempfile.TemporaryDirectory() as folder:
        write_manifest(folder, _BODY)
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            return f.read()


MANIFEST_TEXT = _valid_manifest_text()
EXPECTED_BODY = {k: v for k, v in json.loads(MANIFEST_TEXT).items() if k != "checksum"}


def _manifest_bytes(how, cut, junk, seed, value, path_pick):
    """Mutated manifest bytes, and whether the mutation re-signed them (fixed checksum)."""
    text = MANIFEST_TEXT
    cut %= len(text) + 1
    if how == "keep":
        return text, False
    if how == "truncate":
        return text[:cut], False
    if how == "splice":
        return text[:cut] + junk + text[cut + 1:], False
    if how == "flip":  # one bit of one byte
        b = bytearray(text)
        if b:
            b[cut % len(b)] ^= 1 << (seed % 8)
        return bytes(b), False
    doc = json.loads(text)
    body = {k: v for k, v in doc.items() if k != "checksum"}
    paths = list(_paths(body))[1:]
    body = _mutate(body, paths[path_pick % len(paths)], "delete" if how == "delete" else "set", value)
    if how.endswith("resigned") and isinstance(body, dict):
        # A writer that computed a valid checksum over a broken body: the structural checks must catch it.
        return json.dumps({**body, "checksum": _body_checksum(body)}).encode(), True
    return json.dumps({**body, "checksum": doc["checksum"]} if isinstance(body, dict) else body).encode(), False


def _manifest(folder, how, cut, junk, seed, value, path_pick):
    data, resigned = _manifest_bytes(how, cut, junk, seed, value, path_pick)
    with open(os.path.join(folder, MANIFEST), "wb") as f:
        f.write(data)
    try:
        body = read_manifest(folder)
    except CorruptCheckpoint as e:
        assert MANIFEST in str(e), str(e)  # names the file
        return "clear error"
    if resigned:  # a re-signed body is accepted only when it has what a loader needs
        assert isinstance(body["files"], dict) and isinstance(body["step"], int), body
    else:  # otherwise anything accepted must be the body that was written, exactly
        assert body == EXPECTED_BODY, (data, body)
    return COMPARED


def fuzz_manifest():
    """Counter of outcomes: read_manifest on truncated, spliced, bit-flipped and
    structurally mutated (optionally re-signed) manifests."""
    with tempfile.TemporaryDirectory() as folder:
        return run_surface(
            lambda **kw: _manifest(folder, **kw),
            dict(how=st.sampled_from(["keep", "truncate", "splice", "flip", "set", "delete", "set_resigned"]),
                 cut=st.integers(0, 10**6), junk=st.binary(max_size=6), seed=st.integers(0, 7),
                 value=json_values, path_pick=st.integers(0, 100)),
            examples=[dict(how="truncate", cut=0, junk=b"", seed=0, value=None, path_pick=0),
                      dict(how="splice", cut=0, junk=b"\xff\xfe", seed=0, value=None, path_pick=0)])


def test_manifest_error_or_body():
    assert_compared(fuzz_manifest(), 0.1)


# Every surface with its minimum compared fraction, for bench/fuzz.py (make fuzz).# Every surface with its minimum compared fraction, for bench/fuzz.py (make fuzz).
SURFACES = {
    "plan JSON (structural)": (fuzz_plan_json_structural, 0.1),
    "plan JSON (text)": (fuzz_plan_json_text, 0.1),
    "CLI arguments": (fuzz_cli, 0.1),
    "checkpoint manifest": (fuzz_manifest, 0.1),
}
