"""cpkv reference backend: every op in plain torch, on CPU and GPU.

Kept light: the ``cpkv.backends`` entry point loads :mod:`cpkv_backend_torch.plugin`, which
imports this package; ops are imported only when the backend is loaded.
"""
