"""An example third-party cpkv backend: provides ``rerange`` only.

Light on purpose: the ``cpkv.backends`` entry point loads :mod:`cpkv_example_backend.plugin`,
which imports this package; the op (and torch) are imported only when the backend is loaded.
"""

__version__ = "0.1.0"
