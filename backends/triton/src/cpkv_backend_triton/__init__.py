"""cpkv Triton backend: GPU kernels for cpkv's ops (not implemented yet, issue #5).

Kept light: importing this package imports neither triton nor torch.
"""
