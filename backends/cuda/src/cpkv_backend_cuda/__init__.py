"""cpkv CUDA backend: custom CUDA kernels built lazily on first use (not implemented yet, issue #5).

Kept light: importing this package neither imports torch nor builds anything.
"""
