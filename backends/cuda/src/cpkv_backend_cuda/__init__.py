"""cpkv CUDA backend: custom CUDA kernels built lazily on first use (none yet: docs/perf.md names
the first one, a sparse-MLA kernel with TMA gathers).

Kept light: importing this package neither imports torch nor builds anything.
"""
