"""Mesh inference: placing the code outside the pipelined region (the optimizer update,
metrics) on the meshes that use its results."""
