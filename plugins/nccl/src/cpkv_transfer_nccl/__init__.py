"""cpkv KV transfer over torch.distributed point-to-point: NCCL on GPUs, Gloo on CPUs.
Kept light: importing this package does not import torch (the transport is in ``transport``).
"""
