"""The train-step compiler: trace, cut at stages, infer meshes, emit per-mesh programs."""
