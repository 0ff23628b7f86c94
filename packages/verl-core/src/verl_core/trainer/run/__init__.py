"""A run on disk: the run folder, checkpoints (layout, manifests, RNG state, resume rules), the run context, export."""
