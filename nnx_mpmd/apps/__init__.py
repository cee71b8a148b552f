"""Applications built on the library: the ``nnx-mpmd`` command line and its parts.

``cli`` (the entry point), ``train`` and ``train_loop`` (``nnx-mpmd train``),
``bench`` (``nnx-mpmd bench``), ``launch`` (``nnx-mpmd launch``), ``data`` (the
text corpora and batches) and ``sampling`` (text generation). Nothing in the
library's core imports this package.
"""
