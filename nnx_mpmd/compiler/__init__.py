"""The train-step compiler: named passes from a traced step to per-mesh instruction lists.

`ir` holds the instructions and their text form; the passes run bottom to top through
`trace` (trace, cut at stages, per-stage programs), `region` (schedule lowering,
transfers, outputs), `outer` (mesh inference for the code outside the region) and
`final` (donation, transfer batching, and `final.step`, which composes them all).
"""
