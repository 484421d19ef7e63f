"""The unit groups' data: a group of units and the slices of the tensors each unit owns.

units.py finds the groups (blocks.py the block groups); the plan, its JSON and the engine
read them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Member:
    """A group's slice spec of one tensor: unit j's slice of `name` is [offset + j*width,
    offset + (j+1)*width) along `dim` (0: rows, 1: columns). A fused tensor lists one Member
    per block of its layout (fused qkv: offsets 0, E and 2E), so a unit owns several column
    or row blocks of the same tensor."""

    name: str
    dim: int
    width: int
    buffer: bool = False
    offset: int = 0


@dataclass(frozen=True)
class UnitGroup:
    """One block (size 1, `params` listed whole) or one neuron group (`members` sliced).

    kind: "block", "neuron", "head" or "channel".
    path: module path, as in model.named_modules().
    size: number of units in the group.
    members: sliced parameters and buffers (neuron groups).
    params / buffers: names held whole by the block unit (block groups).
    consumers: module paths whose input is the group's width (for scale="inverse").
    skip: how a skipped block computes its output: "identity", "shortcut" (its skip
        path, no ReLU: pre-activation blocks) or "shortcut_relu" (relu of its skip path).
    Frozen, its lists held as tuples: a plan's groups never change (dataclasses.replace makes another).
    """

    kind: str
    path: str
    size: int
    members: list = field(default_factory=list)
    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    consumers: list = field(default_factory=list)
    skip: str = "identity"

    def __post_init__(self):
        for name in ("members", "params", "buffers", "consumers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def to_dict(self) -> dict:
        """The group as a JSON-ready dict (members as dicts), as stored in the plan JSON."""
        d = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        d["members"] = [asdict(m) for m in self.members]
        return d

    @staticmethod
    def from_dict(d: dict) -> "UnitGroup":
        """The UnitGroup a to_dict() dict describes."""
        d = dict(d)
        d["members"] = [Member(**m) for m in d["members"]]
        return UnitGroup(**d)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
