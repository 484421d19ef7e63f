"""Guards: what stops a run that would go wrong silently (a non-finite gradient, an optimizer built
before wrapping, a state dict that is not a model checkpoint, a sliced attention that drops its
kept heads) and the loss scaler whose skip decision every rank agrees on."""
