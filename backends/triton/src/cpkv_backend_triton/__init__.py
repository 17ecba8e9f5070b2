"""cpkv Triton backend: Triton kernels for cpkv's ops.

:mod:`.kernels` holds the ``@triton.jit`` kernels by op family; the modules here are their thin
wrappers (``kv``, ``attention``, ``topk``, ``indexer_topk``, ``rope``, ``quant``, ``norm``),
composed by ``ops.TritonOps``; :mod:`.tuning` holds the launch constants. Without a CUDA device
the kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is
imported. Kept light: importing this package imports neither triton nor torch.
"""
