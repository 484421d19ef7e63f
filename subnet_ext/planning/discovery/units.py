"""Where the units are: the unit groups, and the neuron groups found in a model.

A *block group* is one residual block (blocks.py finds them): one unit, owning every
parameter inside the block except its shortcut projection. A *neuron group* is a set of
equal slices of several parameters (producer rows, consumer columns, norm entries)
indexed by unit j: slice j of member (param, dim, width) is [j*width, (j+1)*width) along dim.

Neuron groups recognised without help: modules with fc1/fc2 Linears, gated MLPs
(gate_proj/up_proj/down_proj), attention with q_proj/k_proj/v_proj/o_proj (a kv head with
its query heads is one unit), fused-qkv attention (GPT-2's c_attn/c_proj Conv1D, nanoGPT's
c_attn/c_proj Linear with `n_head` or `num_heads`, timm's qkv/proj Linear: one unit per
head, three column/row blocks of the fused tensor), nn.MultiheadAttention (one unit per head,
mha_group below), c_fc/c_proj MLPs (GPT-2's Conv1D,
nanoGPT's Linear), nn.TransformerEncoderLayer (MLP neurons; its attention stays whole), ResNet BasicBlock/
Bottleneck-shaped blocks (inner channels; pre-activation blocks are refused), and plain
nn.Sequential stacks of Linear layers with BatchNorm1d and element-wise layers between
them (alternate hidden layers, so no weight sits between two masked groups; a
BatchNorm1d in a masked layer is sliced). Users declare the rest:
`neuron_groups=[("producer.path", "consumer.path"), ...]`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .residual import is_pre_activation, pre_activation_error
from .unit_group import Member, UnitGroup, _join  # noqa: F401 - re-exported: the planner's names for them
from .unsplit import neuron_level_unsplit

ENCODER_ATTENTION = ("inside nn.TransformerEncoderLayer, whose fused fast path reads the attention's weights and head "
                     "count itself: the layer's MLP neurons are its units, its heads stay whole")

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def mha_refusal(m: nn.MultiheadAttention) -> str | None:
    """Why the planner does not split `m` (torch's nn.MultiheadAttention) by head, or None when it does:
    a subclass (its forward may differ from the one the engine's stand-in reproduces) and
    add_bias_kv=True (bias_k / bias_v are not split) are left whole, the reason in the plan's summary."""
    if type(m) is not nn.MultiheadAttention:
        return f"a subclass of nn.MultiheadAttention ({type(m).__name__}): its forward may differ from torch's, " \
               "which the engine's sliced stand-in reproduces; declare its units or plan at level='block'"
    if m.bias_k is not None or m.bias_v is not None:
        return "add_bias_kv=True: the learned key/value bias rows (bias_k, bias_v) are not split by head; plan " \
               "it at level='block'"
    return None


def mha_group(m: nn.MultiheadAttention, path: str) -> UnitGroup:
    """The head group of torch's nn.MultiheadAttention at `path`: one unit per head. With E = embed_dim,
    H = num_heads and d = head_dim = E / H, head h owns
    - packed in-projection (kdim = vdim = E): rows h*d .. (h+1)*d of each of the q, k and v blocks of
      `in_proj_weight` [3E, E] (offsets 0, E, 2E), and of `in_proj_bias` [3E];
    - separate in-projections (kdim or vdim other than E): rows h*d .. (h+1)*d of `q_proj_weight`
      [E, E], `k_proj_weight` [E, kdim], `v_proj_weight` [E, vdim], and of the three blocks of
      `in_proj_bias`;
    - columns h*d .. (h+1)*d of `out_proj.weight` [E, E] (out_proj's bias is shared).
    The module's forward calls F.multi_head_attention_forward with its own head count and reads its
    projections' tensors itself (it never calls out_proj), so each regime has a stand-in for it:
    engine/layers/sliced_attention.py (forward regime: the kept heads) and engine/regimes/surgery.py (backward
    regime: out_proj's owned columns assembled before the forward)."""
    e, d = m.embed_dim, m.head_dim
    members = []
    if m._qkv_same_embed_dim:
        members += [Member(_join(path, "in_proj_weight"), 0, d, offset=o) for o in (0, e, 2 * e)]
    else:
        members += [Member(_join(path, name), 0, d) for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight")]
    if m.in_proj_bias is not None:
        members += [Member(_join(path, "in_proj_bias"), 0, d, offset=o) for o in (0, e, 2 * e)]
    members.append(Member(_join(path, "out_proj", "weight"), 1, d))
    return UnitGroup("head", path, m.num_heads, members=members, consumers=[_join(path, "out_proj")])


def _entries(module: nn.Module, path: str, dim: int, width: int = 1, with_buffers: bool = True) -> list[Member]:
    """Members (slice specs) of a module's own parameters (and float buffers) along dim."""
    out = [Member(_join(path, n), dim, width) for n, p in module.named_parameters(recurse=False)
           if not (dim == 0 and p.dim() == 0)]
    if with_buffers:
        for n, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dim() >= 1 and n in module._buffers \
                    and n not in module._non_persistent_buffers_set:
                out.append(Member(_join(path, n), dim, width, buffer=True))
    return out


def _linear_producer(module: nn.Linear, path: str, width: int = 1) -> list[Member]:
    return _entries(module, path, 0, width)


def _linear_consumer(module: nn.Linear, path: str, width: int = 1) -> list[Member]:
    return [Member(_join(path, "weight"), 1, width)]


def is_basic_block(m: nn.Module) -> bool:
    """ResNet BasicBlock-shaped: conv1, bn1, conv2 and no conv3 (whatever the shortcut is called)."""
    return all(isinstance(getattr(m, a, None), nn.Conv2d) for a in ("conv1", "conv2")) and \
        isinstance(getattr(m, "bn1", None), _NORMS) and not hasattr(m, "conv3")


def is_bottleneck(m: nn.Module) -> bool:
    """ResNet Bottleneck-shaped: conv1, conv2, conv3 and bn2."""
    return all(isinstance(getattr(m, a, None), nn.Conv2d) for a in ("conv1", "conv2", "conv3")) and \
        isinstance(getattr(m, "bn2", None), _NORMS)


def _is_attention(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("q_proj", "k_proj", "v_proj", "o_proj"))


def _is_gated_mlp(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj"))


def _is_fc_mlp(m: nn.Module) -> bool:
    return isinstance(getattr(m, "fc1", None), nn.Linear) and isinstance(getattr(m, "fc2", None), nn.Linear)


def is_decoder_layer(m: nn.Module) -> bool:
    """A transformers-style *DecoderLayer with self_attn and mlp."""
    return hasattr(m, "self_attn") and hasattr(m, "mlp") and type(m).__name__.endswith("DecoderLayer")


def _is_conv1d(m) -> bool:
    """transformers' Conv1D: y = x @ W + b with W [in, out] (GPT-2), recognised without importing it."""
    return type(m).__name__ == "Conv1D" and isinstance(getattr(m, "nf", None), int) and \
        getattr(getattr(m, "weight", None), "dim", lambda: 0)() == 2


def _is_conv1d_mlp(m: nn.Module) -> bool:
    return _is_conv1d(getattr(m, "c_fc", None)) and _is_conv1d(getattr(m, "c_proj", None))


def _is_linear_mlp(m: nn.Module) -> bool:
    """nanoGPT-style MLP: c_fc and c_proj nn.Linear."""
    return isinstance(getattr(m, "c_fc", None), nn.Linear) and isinstance(getattr(m, "c_proj", None), nn.Linear)


def _head_count(m: nn.Module) -> int | None:
    """The attention's head count: `num_heads` (GPT-2, timm) or `n_head` (nanoGPT)."""
    for attr in ("num_heads", "n_head"):
        value = getattr(m, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _fused_layout(m: nn.Module) -> tuple[str, str, bool] | None:
    """(fused qkv projection, output projection, weights stored [in, out]) of GPT-2's Conv1D
    c_attn/c_proj, nanoGPT's nn.Linear c_attn/c_proj or timm's nn.Linear qkv/proj; else None."""
    c_attn, c_proj = getattr(m, "c_attn", None), getattr(m, "c_proj", None)
    if _is_conv1d(c_attn) and _is_conv1d(c_proj):
        return "c_attn", "c_proj", True
    if isinstance(c_attn, nn.Linear) and isinstance(c_proj, nn.Linear):
        return "c_attn", "c_proj", False
    if isinstance(getattr(m, "qkv", None), nn.Linear) and isinstance(getattr(m, "proj", None), nn.Linear):
        return "qkv", "proj", False
    return None


def _is_fused_attention(m: nn.Module) -> bool:
    """One projection holding q, k and v, an output projection, and a head count."""
    return _fused_layout(m) is not None and _head_count(m) is not None


def is_vit_block(m: nn.Module) -> bool:
    """timm ViT Block: pre-norm attention + MLP, each added to the input."""
    return all(hasattr(m, a) for a in ("norm1", "attn", "norm2", "mlp")) and type(m).__name__ == "Block"


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
        members.append(Member(_join(c, "weight"), 1, 1))
    if len(widths) != 1:
        raise ValueError(f"neuron group {path!r}: producers and consumers disagree on the width: {sorted(widths)}")
    return UnitGroup(kind, path, widths.pop(), members=members, consumers=list(consumers))


def _fused_attention_group(attn: nn.Module, path: str) -> UnitGroup:
    """One unit per head of a fused-qkv attention: head h owns, of the fused projection,
    the q, k and v blocks at offsets h*d, E + h*d and 2E + h*d (E = heads * d), and rows
    (Conv1D) or columns (Linear) h*d .. (h+1)*d of the output projection. The head count
    is `num_heads` or `n_head`; d is `head_dim` where the module has one (checked)."""
    fused, out, transposed = _fused_layout(attn)
    heads = _head_count(attn)
    width = getattr(attn, fused).nf if transposed else getattr(attn, fused).out_features
    head_dim = getattr(attn, "head_dim", None)
    if heads < 1 or width % (3 * heads) or (isinstance(head_dim, int) and width != 3 * heads * head_dim):
        raise ValueError(f"attention {path!r}: fused projection {fused!r} has {width} outputs, not 3 x {heads} "
                         f"heads x head_dim (head_dim {head_dim}; cross-attention or a custom layout): declare "
                         "its units or plan at level='block'")
    for extra in ("q_attn", "gate"):
        if isinstance(getattr(attn, extra, None), nn.Module):
            raise ValueError(f"attention {path!r} has a {extra!r} projection the planner cannot slice by head; "
                             "plan it at block level or declare its units")
    if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
        raise ValueError(f"attention {path!r} normalises across heads ({type(attn.norm).__name__}); a head "
                         "cannot be removed without changing the others: plan it at block level")
    e, d = width // 3, width // 3 // heads
    fused_dim = 1 if transposed else 0  # Conv1D weight is [in, out]: outputs are columns
    members = []
    for offset in (0, e, 2 * e):
        members.append(Member(_join(path, fused, "weight"), fused_dim, d, offset=offset))
        if getattr(attn, fused).bias is not None:
            members.append(Member(_join(path, fused, "bias"), 0, d, offset=offset))
    members.append(Member(_join(path, out, "weight"), 0 if transposed else 1, d))
    return UnitGroup("head", path, heads, members=members, consumers=[_join(path, out)])


def _conv1d_mlp_group(mlp: nn.Module, path: str) -> UnitGroup:
    """GPT-2 MLP: neuron j = column j of c_fc.weight [in, hidden], c_fc.bias[j], row j of
    c_proj.weight [hidden, out]."""
    hidden = mlp.c_fc.nf
    if mlp.c_proj.weight.shape[0] != hidden:
        raise ValueError(f"MLP {path!r}: c_fc has {hidden} outputs but c_proj takes {mlp.c_proj.weight.shape[0]}")
    members = [Member(_join(path, "c_fc", "weight"), 1, 1), Member(_join(path, "c_fc", "bias"), 0, 1),
               Member(_join(path, "c_proj", "weight"), 0, 1)]
    return UnitGroup("neuron", path, hidden, members=members, consumers=[_join(path, "c_proj")])


def _is_plain_stack(m: nn.Module) -> bool:
    """nn.Sequential of Linears, BatchNorm1d and parameter-free layers (activations, dropout)."""
    return isinstance(m, nn.Sequential) and sum(isinstance(c, nn.Linear) for c in m.children()) >= 2 and \
        all(isinstance(c, (nn.Linear, nn.BatchNorm1d)) or not list(c.parameters()) for c in m.children())


def _plain_stack_groups(seq: nn.Sequential, path: str, model) -> list[UnitGroup]:
    children = [(_join(path, n), c) for n, c in seq.named_children()]
    at = [i for i, (_, c) in enumerate(children) if isinstance(c, nn.Linear)]
    groups = []
    # Hidden layer i sits between linears[i] and linears[i+1]; masking layers 0, 2, 4, ...
    # keeps every weight masked on one side only (no element without an owner).
    for i in range(0, len(at) - 1, 2):
        p, c = children[at[i]][0], children[at[i + 1]][0]
        between = children[at[i] + 1:at[i + 1]]
        norms = [n for n, m in between if isinstance(m, nn.BatchNorm1d)]
        mixing = [f"{n} ({type(m).__name__})" for n, m in between
                  if not isinstance(m, nn.BatchNorm1d) and (m._buffers or isinstance(m, (nn.LayerNorm, nn.GroupNorm)))]
        if mixing:
            # Per-feature layers slice; a layer mixing the features (LayerNorm statistics) or
            # holding state the planner cannot slice would compute something else on a subnetwork.
            raise ValueError(f"plain stack {path!r}: {mixing} between {p!r} and {c!r} cannot be sliced by neuron; "
                             "only BatchNorm1d and element-wise layers can sit in a masked hidden layer")
        groups.append(_pair_group(model, "neuron", p, [p], [c], norms))
    return groups


def _declared_groups(model: nn.Module, neuron_groups) -> list[UnitGroup]:
    """The groups the user declared (find_neuron_groups' neuron_groups), checked against the model."""
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


def find_neuron_groups(model: nn.Module, neuron_groups=None, unsplit: dict | None = None) -> list[UnitGroup]:
    """Neuron/head/channel groups, in model order.

    neuron_groups: user declarations, each (producer_path, consumer_path) or
    (list of producers, list of consumers) or (producers, consumers, norms).
    unsplit: filled with {module path: why} of the layers left whole (unsplit.py).
    """
    if neuron_groups is not None:
        return _declared_groups(model, neuron_groups)
    groups, taken, noted = [], set(), {}
    for path, m in model.named_modules():
        if path in taken:
            continue
        if isinstance(m, nn.MultiheadAttention):
            why = mha_refusal(m)
            if why is not None:
                noted[path] = why
                continue
            groups.append(mha_group(m, path))
        elif _is_attention(m):
            groups.append(_attention_group(m, path))
        elif _is_gated_mlp(m):
            groups.append(_pair_group(model, "neuron", path,
                                      [_join(path, "gate_proj"), _join(path, "up_proj")], [_join(path, "down_proj")]))
        elif _is_fc_mlp(m):
            groups.append(_pair_group(model, "neuron", path, [_join(path, "fc1")], [_join(path, "fc2")]))
        elif isinstance(m, nn.TransformerEncoderLayer):
            groups.append(_pair_group(model, "neuron", path, [_join(path, "linear1")], [_join(path, "linear2")]))
            noted[_join(path, "self_attn")] = ENCODER_ATTENTION
        elif (is_bottleneck(m) or is_basic_block(m)) and is_pre_activation(m):
            raise pre_activation_error(path)
        elif is_bottleneck(m):
            groups.append(_pair_group(model, "channel", path, [_join(path, "conv2")], [_join(path, "conv3")],
                                      [_join(path, "bn2")]))
        elif is_basic_block(m):
            groups.append(_pair_group(model, "channel", path, [_join(path, "conv1")], [_join(path, "conv2")],
                                      [_join(path, "bn1")]))
        elif _is_fused_attention(m):
            groups.append(_fused_attention_group(m, path))
        elif _is_conv1d_mlp(m):
            groups.append(_conv1d_mlp_group(m, path))
        elif _is_linear_mlp(m):
            groups.append(_pair_group(model, "neuron", path, [_join(path, "c_fc")], [_join(path, "c_proj")]))
        elif _is_plain_stack(m):
            groups += _plain_stack_groups(m, path, model)
        else:
            continue
        taken.update(p for p, _ in m.named_modules(prefix=path))
    if unsplit is not None:
        unsplit.update(neuron_level_unsplit(model, groups, noted))
    return groups


def check_no_chained(groups: list[UnitGroup]) -> None:
    """Refuse a parameter sliced by two groups: some of its elements would have no owner."""
    seen = {}
    for g in groups:
        names = [m.name for m in g.members] + list(g.params) + list(g.buffers)
        for n in names:
            if n in seen and seen[n] != g.path:
                raise ValueError(f"parameter {n!r} belongs to two unit groups ({seen[n]!r} and {g.path!r}); "
                                 "with static masks some of its elements would have no owner. Declare only one "
                                 "of the two groups (for plain stacks: alternate layers).")
            seen[n] = g.path


def slice_numel(t_shape: torch.Size, member: Member) -> int:
    """Elements of one unit's slice of a tensor of shape t_shape."""
    total = 1
    for s in t_shape:
        total *= s
    return total // t_shape[member.dim] * member.width
