"""cpkv Triton backend: :mod:`.kernels` holds the ``@triton.jit`` kernels by op family, the
modules here their thin wrappers, composed by ``ops.TritonOps``; :mod:`.tuning` the launch
constants. ``TRITON_INTERPRET=1`` (set before triton is imported) runs the kernels on the CPU.
Importing this package imports neither triton nor torch.
"""
