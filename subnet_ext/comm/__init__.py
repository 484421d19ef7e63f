"""Communication: owner-set process groups, bucketed averaging, the backward regime's refresh,
and collectives that fail with a named error instead of hanging."""
