"""Planning: which rank owns which part of the model, decided from the model's structure alone.

Glossary (the words the code uses for parts of the model and of its tensors):

  unit       what a rank owns or not: one block (a residual branch) or unit j of a
             neuron / head / channel group (plan.Unit; its `kind` is "block", "neuron",
             "head" or "channel"; a head is a kv head with its query heads).
  group      a UnitGroup (units.py): one block (size 1, its tensors held whole), or `size`
             equal-width units sliced from the same tensors (neurons, heads, channels).
  member     a group's slice spec of one tensor (units.Member): (tensor name, dim, width,
             offset); unit j owns [offset + j*width, offset + (j+1)*width) along dim
             (0: rows, 1: columns). A fused tensor has one member per block of its layout.
  piece      a slice [start, start + length) along dim of one state-dict tensor with one
             owner set (pieces.Piece): consecutive units with the same owners, or a whole
             tensor (block and shared entries).
  rectangle  (row_begin, row_end, col_begin, col_end): a piece's place in a tensor's 2-D
             view [size(0), numel // size(0)]; *full* in the original-shape tensor
             (pieces.full_rectangle), *local* in the tensor this rank holds it in.
  segment    a rectangle's place in a packed 1-D buffer: one row (tensor index, row_begin,
             row_end, col_begin, col_end, buffer offset) of a segment table (ops/segments.py).
  owner set  the ranks, ascending, that own a unit or a piece (every rank for shared
             tensors); a piece is averaged among exactly its owner set.
  leader     the lowest-ranked owner of a piece (Piece.leader): it alone writes the piece
             when the full model or a checkpoint is assembled, and its values are the ones
             the backward regime's refresh broadcasts.
  bucket     one packed 1-D buffer averaged by one collective (buckets.Bucket): pieces of one
             dtype and one owner set, or of any owner sets, zero-filled, over every rank.
  shared     tensors outside every unit (stem, embeddings, head, final norms): every rank
             holds them (plan.shared).
  alias      a state-dict name for the same tensor as an earlier, canonical name (tied
             weights, aliases.py): no pieces, no owners, never communicated.
  held piece a piece on one rank (comm/places.HeldPiece, the one type for it): the tensor
             holding it, its local and its full rectangle, and the Parameter whose gradient
             carries it. The rank's RankLayout (state/layout.py) says where every piece
             lives and hands comm its held pieces once.
  home       the fixed tensor a communicated parameter's gradient lives in, its `.grad`
             after a synchronising backward: a view of its bucket, or a standalone tensor
             (comm/averaging.py).
"""
