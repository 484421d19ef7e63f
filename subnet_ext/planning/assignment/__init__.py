"""Who owns what: coverage arguments, the static assignment patterns, the schedules of ownership
that move it during training, and the graph of ranks that share units."""
