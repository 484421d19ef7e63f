"""The fuzzing harness shared by planning/test_fuzz.py and ops/test_fuzz_ops.py (and
bench/fuzz.py): hypothesis settings from SUBNET_EXT_FUZZ_EXAMPLES, a runner that counts
each example's outcome, the check that enough examples reached the reference, and JSON
mutation helpers.
"""
import collections
import os

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("SUBNET_EXT_FUZZ_EXAMPLES", "150"))
# database=None: a 10,000-example run must not fill .hypothesis/, and CI runs stay independent.
# derandomize: the test suite draws the same examples on every run (a compared fraction that held
# once holds in CI: one draw of 152 examples reached the reference only 12 times, under the 10% floor);
# SUBNET_EXT_FUZZ_RANDOM=1 (bench/fuzz.py, `make fuzz`) draws new ones each time.
RANDOM = os.environ.get("SUBNET_EXT_FUZZ_RANDOM") == "1"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not RANDOM,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
CLEAR = ValueError  # TORCH_CHECK_VALUE raises ValueError; a RuntimeError is a bug
COMPARED = "checked against the reference"


def run_surface(check, strategies, examples=()):
    """Runs check(**drawn) on FUZZ's examples (plus the explicit `examples`, dicts of
    keyword arguments); check returns its outcome label. Returns Counter{label: count}."""
    counts = collections.Counter()

    def body(**kw):
        outcome = check(**kw)
        event(outcome)
        counts[outcome] += 1

    inner = given(**strategies)(body)
    for kw in examples:
        inner = example(**kw)(inner)
    FUZZ(inner)()
    return counts


def assert_compared(counts, min_fraction):
    """At least min_fraction of the examples (and at least one) reached the reference."""
    total = sum(counts.values())
    assert total > 0 and counts[COMPARED] >= max(1, min_fraction * total), dict(counts)

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
