"""cpkv CUDA backend: custom CUDA kernels built lazily on first use (none yet: docs/perf.md names
the first one, a sparse-MLA kernel with TMA gathers, FlashMLA's structure).

Installed and discoverable (``cpkv plugins`` lists it as unavailable with its reason), but not in
the default backend preference (``["triton", "torch"]``): it joins it, first, once it has kernels.

Kept light: importing this package neither imports torch nor builds anything.
"""
