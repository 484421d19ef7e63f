"""Where the units are: residual blocks and neuron groups found in a model.

A *block group* is one residual branch (ResNet BasicBlock/Bottleneck, a transformer
layer, a residual MLP block): one unit, owning every parameter inside the block except
its shortcut projection. A *neuron group* is a set of equal slices of several
parameters (producer rows, consumer columns, norm entries) indexed by unit j: slice
j of member (param, dim, width) is [j*width, (j+1)*width) along dim.

Recognised without help: modules with fc1/fc2 Linears, gated MLPs (gate_proj/up_proj/
down_proj), attention with q_proj/k_proj/v_proj/o_proj (a kv head with its query
heads is one unit), nn.TransformerEncoderLayer (MLP neurons), torchvision-style
BasicBlock/Bottleneck, and plain nn.Sequential stacks of Linear layers (alternate
hidden layers, so no weight sits between two masked groups). Users declare the rest:
`blocks=["path", ...]` and `neuron_groups=[("producer.path", "consumer.path"), ...]`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class Slice:
    """Slice j of `name` is [j*width, (j+1)*width) along `dim` (0: rows, 1: columns)."""

    name: str
    dim: int
    width: int
    buffer: bool = False


@dataclass
class UnitGroup:
    """One block (size 1, `params` listed whole) or one neuron group (`members` sliced).

    kind: "block", "neuron", "head" or "channel".
    path: module path, as in model.named_modules().
    size: number of units in the group.
    members: sliced parameters and buffers (neuron groups).
    params / buffers: names held whole by the block unit (block groups).
    consumers: module paths whose input is the group's width (for scale="inverse").
    skip: how a skipped block computes its output: "identity" or "shortcut".
    """

    kind: str
    path: str
    size: int
    members: list = field(default_factory=list)
    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    consumers: list = field(default_factory=list)
    skip: str = "identity"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["members"] = [asdict(m) for m in self.members]
        return d

    @staticmethod
    def from_dict(d: dict) -> "UnitGroup":
        d = dict(d)
        d["members"] = [Slice(**m) for m in d["members"]]
        return UnitGroup(**d)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _entries(module: nn.Module, path: str, dim: int, width: int = 1, with_buffers: bool = True) -> list[Slice]:
    """Slices of a module's own parameters (and float buffers) along dim."""
    out = [Slice(_join(path, n), dim, width) for n, p in module.named_parameters(recurse=False)
           if not (dim == 0 and p.dim() == 0)]
    if with_buffers:
        for n, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dim() >= 1 and n in module._buffers \
                    and n not in module._non_persistent_buffers_set:
                out.append(Slice(_join(path, n), dim, width, buffer=True))
    return out


def _linear_producer(module: nn.Linear, path: str, width: int = 1) -> list[Slice]:
    return _entries(module, path, 0, width)


def _linear_consumer(module: nn.Linear, path: str, width: int = 1) -> list[Slice]:
    return [Slice(_join(path, "weight"), 1, width)]


def _is_basic_block(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Conv2d) for a in ("conv1", "conv2")) and \
        isinstance(getattr(m, "bn1", None), _NORMS) and not hasattr(m, "conv3")


def _is_bottleneck(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Conv2d) for a in ("conv1", "conv2", "conv3")) and \
        isinstance(getattr(m, "bn2", None), _NORMS)


def _is_attention(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))


def _is_gated_mlp(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj"))


def _is_fc_mlp(m: nn.Module) -> bool:
    return isinstance(getattr(m, "fc1", None), nn.Linear) and isinstance(getattr(m, "fc2", None), nn.Linear)


def _is_decoder_layer(m: nn.Module) -> bool:
    return hasattr(m, "self_attn") and hasattr(m, "mlp") and type(m).__name__.endswith("DecoderLayer")


def is_recognised_block(m: nn.Module) -> bool:
    """Residual blocks the planner knows how to skip."""
    return (_is_basic_block(m) or _is_bottleneck(m) or _is_decoder_layer(m)
            or isinstance(m, nn.TransformerEncoderLayer) or type(m).__name__ == "ResidualMLPBlock")


def _block_group(model: nn.Module, path: str) -> UnitGroup:
    block = model.get_submodule(path)
    shortcut = "downsample" if isinstance(getattr(block, "downsample", None), nn.Module) else None
    skip = "shortcut" if (_is_basic_block(block) or _is_bottleneck(block)) else "identity"
    params, buffers = [], []
    for n, _ in block.named_parameters():
        if shortcut is None or not n.startswith(shortcut + "."):
            params.append(_join(path, n))
    for n, b in block.named_buffers():
        owner_path, _, leaf = n.rpartition(".")
        owner = block.get_submodule(owner_path) if owner_path else block
        if leaf in owner._non_persistent_buffers_set:
            continue
        if shortcut is None or not n.startswith(shortcut + "."):
            buffers.append(_join(path, n))
    if not params:
        raise ValueError(f"block {path!r} has no parameters outside its shortcut; it cannot be a unit")
    return UnitGroup("block", path, 1, params=params, buffers=buffers, skip=skip)


def find_blocks(model: nn.Module, blocks=None) -> list[UnitGroup]:
    """Block groups, in model order. `blocks`: module paths declared by the user."""
    if blocks is not None:
        names = dict(model.named_modules())
        for b in blocks:
            if b not in names or b == "":
                raise ValueError(f"declared block {b!r} is not a submodule path of the model "
                                 f"(see model.named_modules())")
        return [_block_group(model, b) for b in blocks]
    found, taken = [], []
    for path, m in model.named_modules():
        if any(path.startswith(t + ".") for t in taken):
            continue  # a block inside a block: the outer one is the unit
        if path and is_recognised_block(m):
            found.append(_block_group(model, path))
            taken.append(path)
    return found


def _attention_group(attn: nn.Module, path: str) -> UnitGroup:
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:
        raise ValueError(f"attention {path!r} has no head_dim attribute; declare its units explicitly")
    n_heads = attn.q_proj.out_features // head_dim
    n_kv = attn.k_proj.out_features // head_dim
    if n_kv < 1 or n_heads % n_kv:
        raise ValueError(f"attention {path!r}: {n_heads} query heads do not split into {n_kv} kv heads")
    g = n_heads // n_kv
    members = (_linear_producer(attn.q_proj, _join(path, "q_proj"), g * head_dim)
               + _linear_producer(attn.k_proj, _join(path, "k_proj"), head_dim)
               + _linear_producer(attn.v_proj, _join(path, "v_proj"), head_dim)
               + _linear_consumer(attn.o_proj, _join(path, "o_proj"), g * head_dim))
    return UnitGroup("head", path, n_kv, members=members, consumers=[_join(path, "o_proj")])


def _pair_group(model, kind, path, producers, consumers, norms=()) -> UnitGroup:
    """A neuron group from producer modules (rows), norms (entries) and consumers (columns)."""
    widths = set()
    members = []
    for p in producers:
        m = model.get_submodule(p)
        widths.add(m.weight.shape[0])
        members += _entries(m, p, 0)
    for n in norms:
        members += _entries(model.get_submodule(n), n, 0)
    for c in consumers:
        m = model.get_submodule(c)
        if m.weight.dim() < 2:
            raise ValueError(f"consumer {c!r} has a {m.weight.dim()}-D weight; it needs input columns")
        widths.add(m.weight.shape[1])
        members.append(Slice(_join(c, "weight"), 1, 1))
    if len(widths) != 1:
        raise ValueError(f"neuron group {path!r}: producers and consumers disagree on the width: {sorted(widths)}")
    return UnitGroup(kind, path, widths.pop(), members=members, consumers=list(consumers))


def _plain_stack_groups(seq: nn.Sequential, path: str, model) -> list[UnitGroup]:
    linears = [(_join(path, n), m) for n, m in seq.named_children() if isinstance(m, nn.Linear)]
    groups = []
    # Hidden layer i sits between linears[i] and linears[i+1]; masking layers 0, 2, 4, ...
    # keeps every weight masked on one side only (no element without an owner).
    for i in range(0, len(linears) - 1, 2):
        (p, _), (c, _) = linears[i], linears[i + 1]
        groups.append(_pair_group(model, "neuron", p, [p], [c]))
    return groups


def find_neuron_groups(model: nn.Module, neuron_groups=None) -> list[UnitGroup]:
    """Neuron/head/channel groups, in model order.

    neuron_groups: user declarations, each (producer_path, consumer_path) or
    (list of producers, list of consumers) or (producers, consumers, norms).
    """
    if neuron_groups is not None:
        out = []
        for decl in neuron_groups:
            if len(decl) not in (2, 3):
                raise ValueError(f"a neuron group is (producers, consumers[, norms]), got {decl!r}")
            prods, cons = ([d] if isinstance(d, str) else list(d) for d in decl[:2])
            norms = [] if len(decl) == 2 else ([decl[2]] if isinstance(decl[2], str) else list(decl[2]))
            names = dict(model.named_modules())
            for p in prods + cons + norms:
                if p not in names:
                    raise ValueError(f"declared neuron group names {p!r}, which is not a submodule of the model")
            out.append(_pair_group(model, "neuron", prods[0], prods, cons, norms))
        return out
    groups, taken = [], set()
    for path, m in model.named_modules():
        if path in taken:
            continue
        if _is_attention(m):
            groups.append(_attention_group(m, path))
        elif _is_gated_mlp(m):
            groups.append(_pair_group(model, "neuron", path,
                                      [_join(path, "gate_proj"), _join(path, "up_proj")], [_join(path, "down_proj")]))
        elif _is_fc_mlp(m):
            groups.append(_pair_group(model, "neuron", path, [_join(path, "fc1")], [_join(path, "fc2")]))
        elif isinstance(m, nn.TransformerEncoderLayer):
            groups.append(_pair_group(model, "neuron", path, [_join(path, "linear1")], [_join(path, "linear2")]))
        elif _is_bottleneck(m):
            groups.append(_pair_group(model, "channel", path, [_join(path, "conv2")], [_join(path, "conv3")],
                                      [_join(path, "bn2")]))
        elif _is_basic_block(m):
            groups.append(_pair_group(model, "channel", path, [_join(path, "conv1")], [_join(path, "conv2")],
                                      [_join(path, "bn1")]))
        elif isinstance(m, nn.Sequential) and sum(isinstance(c, nn.Linear) for c in m.children()) >= 2 \
                and all(isinstance(c, nn.Linear) or not list(c.parameters()) for c in m.children()):
            groups += _plain_stack_groups(m, path, model)
        else:
            continue
        taken.update(p for p, _ in m.named_modules(prefix=path))
    return groups


def check_no_chained(groups: list[UnitGroup]) -> None:
    """Refuse a parameter sliced by two groups: some of its elements would have no owner."""
    seen = {}
    for g in groups:
        names = [m.name for m in g.members] + g.params + g.buffers
        for n in names:
            if n in seen and seen[n] != g.path:
                raise ValueError(f"parameter {n!r} belongs to two unit groups ({seen[n]!r} and {g.path!r}); "
                                 "with static masks some of its elements would have no owner. Declare only one "
                                 "of the two groups (for plain stacks: alternate layers).")
            seen[n] = g.path


def slice_numel(t_shape: torch.Size, member: Slice) -> int:
    """Elements of one unit's slice of a tensor of shape t_shape."""
    total = 1
    for s in t_shape:
        total *= s
    return total // t_shape[member.dim] * member.width
