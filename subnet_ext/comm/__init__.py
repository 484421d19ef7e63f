"""Communication: owner-set process groups, bucketed averaging and its reductions (the
all-reduce, or a comm hook: `hooks/` has the fp16/bf16 casts and the low-rank one), the
backward regime's refresh, and collectives that fail with a named error instead of hanging."""
