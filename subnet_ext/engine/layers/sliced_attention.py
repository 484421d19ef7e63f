"""Forward regime: torch's nn.MultiheadAttention running only the heads this rank owns.

nn.MultiheadAttention's forward calls F.multi_head_attention_forward, which takes the head
width as embed_dim / num_heads with embed_dim the *input's* width: with h of H heads kept
(projections sliced to h x head_dim rows, planning/discovery/units.py mha_group) it would split them
into heads of the wrong width. `SlicedMultiheadAttention` stands in for it (module_swaps.py,
the user's module set aside, as SlicedLinear for an nn.Linear): the same class, attributes,
tensors and submodules, `num_heads` = h (slicing.py), `head_dim` unchanged, and a forward
that computes F.multi_head_attention_forward's result for the kept heads, with the same
arguments and masks: q, k, v from the sliced in-projections (packed or separate), heads of
head_dim, the scaled dot product with the attention mask and key padding mask merged as torch
merges them (a 3-D mask [N*H, L, S] cut to the kept heads), dropout on the weights in
training, `add_zero_attn`, the output projection over the kept heads' columns (out_proj's
input columns sliced in step with the heads), batch_first or not, batched or not.
`need_weights` returns the weights of the kept heads (averaged over them by default).
Not covered: the fused fast path (an inference optimisation: the result is the same) and
add_bias_kv (the planner leaves such an attention whole).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..regimes.module_swaps import twin


class SlicedMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention holding h of its heads (module docstring). Attributes beyond the
    module's: `kept_heads` (long [h], the global indices of the heads it holds, ascending),
    `full_heads` (H), `out_input_scale` (the inverse scale of the consumer's input, 1.0 unless
    scale="inverse")."""

    kept_heads: torch.Tensor
    full_heads: int
    out_input_scale: float = 1.0

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        """As nn.MultiheadAttention.forward for the kept heads: (output [N, L, E] or [L, N, E]
        (batch_first) or [L, E] unbatched, weights [N, L, S] / [N, h, L, S] or None)."""
        batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if self.batch_first and batched:
            query, key, value = (t.transpose(1, 0) for t in (query, key, value))
        if not batched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # the scaled dot product applies the causal mask itself
        elif key_padding_mask is not None:
            is_causal = False
        out, weights = self._kept_heads_attention(query, key, value, key_padding_mask, need_weights, attn_mask,
                                                  is_causal)
        if need_weights and average_attn_weights:
            weights = weights.mean(dim=1)
        if not batched:
            out = out.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        return (out.transpose(1, 0) if self.batch_first and batched else out), weights

    def _projections(self):
        """(w_q, w_k, w_v, b_q, b_k, b_v) of the kept heads: [h*d, E], [h*d, kdim], [h*d, vdim], [h*d] or None."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return w_q, w_k, w_v, b_q, b_k, b_v

    def _mask(self, attn_mask, n: int, length: int, source: int):
        """The attention mask as [1 or N*h, L, S]: a 2-D mask broadcast, a 3-D one cut to the kept heads."""
        if attn_mask is None:
            return None
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (length, source):
                raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be "
                                   f"{(length, source)}.")
            return attn_mask.unsqueeze(0)
        if attn_mask.dim() != 3 or tuple(attn_mask.shape) != (n * self.full_heads, length, source):
            raise RuntimeError(f"The shape of the attn_mask is {tuple(attn_mask.shape)}, but should be "
                               f"{(length, source)} or {(n * self.full_heads, length, source)}.")
        heads = self.kept_heads.to(attn_mask.device)
        return attn_mask.view(n, self.full_heads, length, source)[:, heads].reshape(-1, length, source)

    def _kept_heads_attention(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """F.multi_head_attention_forward's computation for h heads of head_dim; query [L, N, E],
        key [S, N, kdim], value [S, N, vdim]. Returns (out [L, N, E], weights [N, h, L, S] or None)."""
        length, n, _ = query.shape
        h, d = self.num_heads, self.head_dim
        w_q, w_k, w_v, b_q, b_k, b_v = self._projections()
        q = F.linear(query, w_q, b_q).view(length, n * h, d).transpose(0, 1)
        k = F.linear(key, w_k, b_k).view(key.shape[0], n * h, d).transpose(0, 1)
        v = F.linear(value, w_v, b_v).view(value.shape[0], n * h, d).transpose(0, 1)
        attn_mask = self._mask(attn_mask, n, length, key.shape[0])
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros((n * h, 1, d))], dim=1)
            v = torch.cat([v, v.new_zeros((n * h, 1, d))], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        source = k.shape[1]
        if key_padding_mask is not None:
            padding = key_padding_mask.view(n, 1, 1, source).expand(-1, h, -1, -1).reshape(n * h, 1, source)
            attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            scores = torch.bmm(q * math.sqrt(1.0 / d), k.transpose(-2, -1))
            weights = torch.softmax(scores if attn_mask is None else scores + attn_mask, dim=-1)
            if dropout > 0.0:
                weights = F.dropout(weights, p=dropout)
            heads = torch.bmm(weights, v)  # [N*h, L, d]
            weights = weights.view(n, h, length, source)
        else:
            if attn_mask is not None:
                attn_mask = attn_mask.unsqueeze(0) if attn_mask.size(0) == 1 else attn_mask.view(n, h, -1, source)
            heads = F.scaled_dot_product_attention(q.view(n, h, length, d), k.view(n, h, source, d),
                                                   v.view(n, h, source, d), attn_mask, dropout, is_causal)
            heads = heads.view(n * h, length, d)
            weights = None
        heads = heads.transpose(0, 1).reshape(length * n, h * d)
        if self.out_input_scale != 1.0:
            heads = heads * self.out_input_scale
        out = F.linear(heads, self.out_proj.weight, self.out_proj.bias)
        return out.view(length, n, out.shape[-1]), weights


def attention_stand_in(module: nn.Module) -> nn.Module:
    """The engine's stand-in for a head group's attention before slicing: a SlicedMultiheadAttention
    for an nn.MultiheadAttention (exactly that class), else the module's twin (module_swaps.py)."""
    if type(module) is not nn.MultiheadAttention:
        return twin(module)
    layer = twin(module, SlicedMultiheadAttention)
    layer.full_heads = module.num_heads
    layer.kept_heads = torch.arange(module.num_heads)
    return layer
