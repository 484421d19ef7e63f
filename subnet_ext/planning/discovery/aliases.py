"""Tied weights: state-dict names that are the same tensor as an earlier name.

`lm_head.weight is embed_tokens.weight` (tie_word_embeddings) gives a state dict with both
names for one tensor, while model.named_parameters() lists it once. The plan keeps the
first name (the canonical one) and records the later ones as aliases: one tensor, one set
of owners, one piece list, averaged once; aliases get no pieces and are never
communicated. Exports write each alias beside its canonical name (state/tied_exports.py).
"""
from __future__ import annotations

import torch.nn as nn


def _storage_key(t):
    """Same memory: storage pointer, offset, shape, stride and dtype (None on meta, where
    every tensor's pointer is 0: only identity can tell a tie there)."""
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def find_aliases(model: nn.Module, groups: list) -> dict:
    """{alias: canonical name} over model.state_dict(keep_vars=True), in its order.

    Raises:
        ValueError: a tie that reaches into a unit (a sliced member, or a block's tensor
            tied to a tensor outside that block): one tensor cannot have two sets of owners.
    """
    block_of = {}
    for g in groups:
        for n in g.params + g.buffers:
            block_of[n] = g.path
        for m in g.members:
            block_of[m.name] = f"{g.path} (sliced)"
    first_by_id, first_by_storage, aliases = {}, {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        canonical = first_by_id.get(id(t))
        key = _storage_key(t)
        if canonical is None and key is not None:
            canonical = first_by_storage.get(key)
        if canonical is None:
            first_by_id[id(t)] = name
            if key is not None:
                first_by_storage[key] = name
            continue
        a, b = block_of.get(canonical), block_of.get(name)
        if a != b or (a is not None and a.endswith("(sliced)")):
            raise ValueError(f"{name!r} is the same tensor as {canonical!r} (tied weights), but they sit in "
                             f"different units ({a or 'shared'} vs {b or 'shared'}); tied tensors must both be "
                             "shared or both inside one block: untie them or declare other units")
        aliases[name] = canonical
    return aliases
