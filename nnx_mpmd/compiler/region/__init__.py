"""The pipelined region's passes: schedule lowering, transfers, overlapped tasks,
outputs; `region_plan` composes them."""
