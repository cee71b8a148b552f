"""The last passes over the whole step's instruction list (donation, transfer batching)
and `step`, the pass manager that lowers a traced step through every floor below."""
