"""cpkv Triton backend: Triton kernels for cpkv's ops (issue #5).

``kv.py`` holds the KV kernels (page_gather, page_scatter, rerange, fp8_pack, fp8_unpack),
``attention.py`` the sparse-attention ones, ``rope.py`` the rotary embedding; ``ops.TritonOps``
composes them. Without a CUDA device
the kernels run in Triton's interpreter when ``TRITON_INTERPRET=1`` is set before triton is
imported. Kept light: importing this package imports neither triton nor torch.
"""
