"""Reading a model: its units (neuron groups, heads, channels; residual blocks and their skip paths,
traced by torch.fx or from one real call), tied aliases, the modules left whole and why, FLOPs."""
