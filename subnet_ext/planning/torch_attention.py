"""torch's own attention, nn.MultiheadAttention, as a head group: one unit per head.

With E = embed_dim, H = num_heads and d = head_dim = E / H, head h owns
- packed in-projection (kdim = vdim = E): rows h*d .. (h+1)*d of each of the q, k and v
  blocks of `in_proj_weight` [3E, E] (offsets 0, E, 2E), and of `in_proj_bias` [3E];
- separate in-projections (kdim or vdim other than E): rows h*d .. (h+1)*d of
  `q_proj_weight` [E, E], `k_proj_weight` [E, kdim], `v_proj_weight` [E, vdim], and of the
  three blocks of `in_proj_bias`;
- columns h*d .. (h+1)*d of `out_proj.weight` [E, E] (out_proj's bias is shared).

The module's forward calls F.multi_head_attention_forward with its own head count and reads
its projections' tensors itself (it never calls out_proj), so each regime has a stand-in for
it: engine/sliced_attention.py (forward regime: the kept heads, a consistent head count) and
engine/surgery.py (backward regime: out_proj's owned columns assembled before the forward).

Left whole, with the reason in the plan's summary: a subclass (its forward may differ from
the one the stand-in reproduces) and add_bias_kv=True (bias_k / bias_v are not split).
"""
from __future__ import annotations

import torch.nn as nn

from .unit_group import Member, UnitGroup, _join


def mha_refusal(m: nn.MultiheadAttention) -> str | None:
    """Why the planner does not split `m` by head, or None when it does."""
    if type(m) is not nn.MultiheadAttention:
        return f"a subclass of nn.MultiheadAttention ({type(m).__name__}): its forward may differ from torch's, " \
               "which the engine's sliced stand-in reproduces; declare its units or plan at level='block'"
    if m.bias_k is not None or m.bias_v is not None:
        return "add_bias_kv=True: the learned key/value bias rows (bias_k, bias_v) are not split by head; plan " \
               "it at level='block'"
    return None


def mha_group(m: nn.MultiheadAttention, path: str) -> UnitGroup:
    """The head group of an nn.MultiheadAttention at `path` (module docstring)."""
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
