"""Each regime's change of the user's model: the surgery, the slicing of a group to its owned units,
the swap record that close() undoes, the meta tensors of what a rank does not hold, eval-mode
forwards and owner-fraction residual scaling."""
