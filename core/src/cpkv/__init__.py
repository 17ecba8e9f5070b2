"""cpkv: page-aligned shared KV for context-parallel prefill of sparse-attention models."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cpkv-core")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0"

__all__ = ["__version__"]
