"""Validation of a plan read from JSON, before any of it is used.

A plan file is input: hand-edited, truncated, from another version, or fuzzed. Every
field is checked for type and range, and the fields are checked against each other —
the fingerprint against the tensor shapes and dtypes, every group member against the
tensor it slices, every tensor held by exactly one group or shared, the owner matrix
against the world size and the unit count, the traced FLOPs (optional: plans written
before them fall back to 2 x parameters) against the unit count — so `SubnetPlan.from_json` either returns a
plan that is consistent or raises ValueError naming the first problem.
"""
from __future__ import annotations

import hashlib
import math

from ..vocabulary import KINDS, LEVELS

DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
SKIPS = ("identity", "shortcut", "shortcut_relu")
GROUP_KEYS = {"kind", "path", "size", "members", "params", "buffers", "consumers", "skip"}
SLICE_KEYS = {"name", "dim", "width", "buffer", "offset"}
REQUIRED = ("format", "world_size", "coverage", "level", "seed", "fingerprint", "groups", "shared", "owners",
            "tensor_shapes", "tensor_dtypes", "param_names")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(d: dict, key: str, shapes: dict) -> list:
    value = d.get(key)
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"plan JSON: {key!r} must be a list of tensor names")
    unknown = [n for n in value if n not in shapes]
    if unknown:
        raise ValueError(f"plan JSON: {key!r} names tensors the plan does not know: {unknown[:3]}")
    if len(set(value)) != len(value):
        raise ValueError(f"plan JSON: {key!r} lists a tensor twice")
    return value


def fingerprint_of(shapes: dict, dtypes: dict) -> str:
    """plan.model_fingerprint computed from the JSON's own shapes and dtypes (same order)."""
    h = hashlib.sha256()
    for name, shape in shapes.items():
        h.update(f"{name}:{tuple(shape)}:torch.{dtypes[name]};".encode())
    return h.hexdigest()[:16]


def _check_header(d: dict) -> None:
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"plan JSON: missing field(s) {missing}")
    if not _int(d["world_size"]) or d["world_size"] < 1:
        raise ValueError(f"plan JSON: world_size must be a positive int, got {d['world_size']!r}")
    c = d["coverage"]
    values = c if isinstance(c, list) else [c]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                         or not 0 < v <= 1 for v in values):
        raise ValueError(f"plan JSON: coverage must be a number in (0, 1] or a list of them (one per rank), got {c!r}")
    if d["level"] not in LEVELS:
        raise ValueError(f"plan JSON: level must be 'block' or 'neuron', got {d['level']!r}")
    if not _int(d["seed"]):
        raise ValueError(f"plan JSON: seed must be an int, got {d['seed']!r}")
    if not isinstance(d["fingerprint"], str):
        raise ValueError("plan JSON: fingerprint must be a string")


def _check_tensors(d: dict) -> dict:
    shapes, dtypes = d["tensor_shapes"], d["tensor_dtypes"]
    if not isinstance(shapes, dict) or not isinstance(dtypes, dict) or list(shapes) != list(dtypes):
        raise ValueError("plan JSON: tensor_shapes and tensor_dtypes must be objects with the same names in order")
    for name, shape in shapes.items():
        if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
            raise ValueError(f"plan JSON: the shape of {name!r} must be a list of ints >= 0, got {shape!r}")
        if dtypes[name] not in DTYPES:
            raise ValueError(f"plan JSON: the dtype of {name!r} must be one of {DTYPES}, got {dtypes[name]!r}")
    if fingerprint_of(shapes, dtypes) != d["fingerprint"]:
        raise ValueError("plan JSON: its tensor shapes and dtypes do not match its fingerprint (edited or corrupt)")
    return shapes


def _check_member(m, g_path: str, size: int, shapes: dict) -> tuple:
    """Returns (name, dim, first index, end index) of the member's span along dim."""
    if not isinstance(m, dict) or set(m) - SLICE_KEYS or not {"name", "dim", "width"} <= set(m):
        raise ValueError(f"plan JSON: a member of group {g_path!r} must have name, dim, width (and buffer, offset)")
    name, dim, width, offset = m["name"], m["dim"], m["width"], m.get("offset", 0)
    if name not in shapes:
        raise ValueError(f"plan JSON: group {g_path!r} slices an unknown tensor {name!r}")
    shape = shapes[name]
    if not _int(dim) or dim not in (0, 1) or dim >= len(shape):
        raise ValueError(f"plan JSON: group {g_path!r} slices {name!r} (shape {shape}) along dim {dim!r}")
    if not _int(width) or width < 1 or not _int(offset) or offset < 0 or offset + size * width > shape[dim]:
        raise ValueError(f"plan JSON: group {g_path!r}: {size} units of width {width!r} from offset {offset!r} "
                         f"do not fit dim {dim} of {name!r} (size {shape[dim]})")
    if not isinstance(m.get("buffer", False), bool):
        raise ValueError(f"plan JSON: 'buffer' of a member of group {g_path!r} must be true or false")
    return name, dim, offset, offset + size * width


def _check_tiling(spans: list, g_path: str, shapes: dict) -> list:
    """The members slicing one tensor (several for a fused layout) must tile one of its dims
    exactly: a gap would leave elements with no owner, an overlap would give them two.
    Returns the distinct tensor names."""
    by_name = {}
    for name, dim, begin, end in spans:
        by_name.setdefault(name, []).append((dim, begin, end))
    for name, parts in by_name.items():
        dims = {dim for dim, _, _ in parts}
        parts.sort(key=lambda p: p[1])
        edges = [0] + [e for _, _, e in parts]
        contiguous = all(b == edges[i] for i, (_, b, _) in enumerate(parts))
        if len(dims) != 1 or not contiguous or edges[-1] != shapes[name][parts[0][0]]:
            raise ValueError(f"plan JSON: group {g_path!r}: the members slicing {name!r} (shape {shapes[name]}) "
                             f"do not tile one dim exactly: (dim, begin, end) = {parts}")
    return list(by_name)


def _check_groups(d: dict, shapes: dict) -> int:
    """Returns the number of units."""
    groups = d["groups"]
    if not isinstance(groups, list) or not groups:
        raise ValueError("plan JSON: groups must be a non-empty list")
    held, units = {}, 0
    for g in groups:
        if not isinstance(g, dict) or set(g) != GROUP_KEYS:
            raise ValueError(f"plan JSON: a group must have exactly the fields {sorted(GROUP_KEYS)}")
        path, kind, size = g["path"], g["kind"], g["size"]
        if not isinstance(path, str) or kind not in KINDS or g["skip"] not in SKIPS:
            raise ValueError(f"plan JSON: group {path!r}: bad path, kind {kind!r} or skip {g['skip']!r}")
        if not _int(size) or size < 1 or (kind == "block") != (d["level"] == "block"):
            raise ValueError(f"plan JSON: group {path!r}: kind {kind!r} with size {size!r} does not fit level "
                             f"{d['level']!r}")
        if kind == "block" and (size != 1 or g["members"]):
            raise ValueError(f"plan JSON: block group {path!r} must have size 1 and no sliced members")
        if kind != "block" and (not g["members"] or g["params"] or g["buffers"]):
            raise ValueError(f"plan JSON: {kind} group {path!r} must slice members and hold no whole tensor")
        if not isinstance(g["members"], list) or not isinstance(g["consumers"], list) or \
                not all(isinstance(c, str) for c in g["consumers"]):
            raise ValueError(f"plan JSON: group {path!r}: members and consumers must be lists")
        names = _check_tiling([_check_member(m, path, size, shapes) for m in g["members"]], path, shapes)
        names += _names(g, "params", shapes) + _names(g, "buffers", shapes)
        for n in names:
            if n in held:
                raise ValueError(f"plan JSON: tensor {n!r} belongs to two groups ({held[n]!r} and {path!r})")
            held[n] = path
        units += size
    shared = _names(d, "shared", shapes)
    both = [n for n in shared if n in held]
    orphans = [n for n in shapes if n not in held and n not in shared]
    if both or orphans:
        raise ValueError(f"plan JSON: every tensor must be shared or in exactly one group; shared and grouped: "
                         f"{both[:3]}, in neither: {orphans[:3]}")
    return units


def _check_owners(d: dict, units: int) -> None:
    owners, k = d["owners"], d["world_size"]
    if not isinstance(owners, list) or len(owners) != k or not all(isinstance(row, list) and len(row) == units
                                                                  for row in owners):
        raise ValueError(f"plan JSON: owners must be a {k} x {units} matrix (world size x units)")
    if not all(v in (0, 1) and (_int(v) or isinstance(v, bool)) for row in owners for v in row):
        raise ValueError("plan JSON: owners must hold only 0 and 1")


def _finite_count(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _check_flops(d: dict, units: int) -> None:
    """The optional "flops" field: {"unit": [units] FLOPs >= 0, "shared": FLOPs >= 0, "source": str}."""
    if "flops" not in d:
        return
    f = d["flops"]
    if not isinstance(f, dict) or set(f) != {"unit", "shared", "source"}:
        raise ValueError("plan JSON: flops must be an object with exactly unit, shared and source")
    if not isinstance(f["unit"], list) or len(f["unit"]) != units or not all(_finite_count(v) for v in f["unit"]):
        got = len(f["unit"]) if isinstance(f["unit"], list) else type(f["unit"]).__name__
        raise ValueError(f"plan JSON: flops.unit must list {units} finite FLOP counts >= 0 (one per unit), got {got}")
    if not _finite_count(f["shared"]) or not isinstance(f["source"], str):
        raise ValueError(f"plan JSON: flops.shared must be a finite count >= 0 and flops.source a string, got "
                         f"{f['shared']!r}, {f['source']!r}")


def check_plan_json(d) -> None:
    """Raise ValueError naming the first problem of a parsed plan JSON (see module docstring)."""
    if not isinstance(d, dict) or d.get("format") != "subnet_ext.plan/1":
        raise ValueError("not a subnet_ext plan (missing format 'subnet_ext.plan/1')")
    _check_header(d)
    shapes = _check_tensors(d)
    params = _names(d, "param_names", shapes)
    aliases = _check_aliases(d, shapes, params)
    units = _check_groups(d, {n: s for n, s in shapes.items() if n not in aliases})
    _check_owners(d, units)
    _check_flops(d, units)


def _check_aliases(d: dict, shapes: dict, params: list) -> dict:
    """Optional "aliases" {alias: canonical} (tied weights; plans written before it have
    none): both names known, same shape and dtype, the canonical one first in the state
    dict and itself no alias, and an alias neither a parameter name nor a unit's tensor."""
    aliases = d.get("aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in aliases.items()):
        raise ValueError(f"plan JSON: aliases must map tensor names to tensor names, got {aliases!r}")
    order = {n: i for i, n in enumerate(shapes)}
    for alias, canonical in aliases.items():
        if alias not in order or canonical not in order or canonical in aliases or \
                order[canonical] >= order[alias] or alias in params or \
                shapes[alias] != shapes[canonical] or d["tensor_dtypes"][alias] != d["tensor_dtypes"][canonical]:
            raise ValueError(f"plan JSON: alias {alias!r} -> {canonical!r} is not a tie of two known tensors of "
                             "the same shape and dtype, the canonical one first")
    return aliases
