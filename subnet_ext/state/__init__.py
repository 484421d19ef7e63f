"""State: this rank's tensors in the full model's coordinates — assembly and loading of full
state dicts, optimizer state, consistency checks, checkpoints and their manifests."""
