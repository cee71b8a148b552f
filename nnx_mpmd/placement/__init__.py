"""Where state lives: `MpmdMesh` and its submeshes, the split of NNX graph state per
mesh (`place`, `gather`), shardings from ``out_sharding`` metadata, and `MpmdArray`.
"""
