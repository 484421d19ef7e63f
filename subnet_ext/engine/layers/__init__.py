"""The engine's layers, standing in for the user's sliced ones: the backward regime's OwnedLinear and
OwnedConv2d over owned views, the forward regime's compact SlicedLinear/SlicedConv2d, the sliced
nn.MultiheadAttention and the width-kept projections."""
