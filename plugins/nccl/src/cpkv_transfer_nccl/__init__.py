"""cpkv KV transfer over torch.distributed point-to-point: NCCL on GPUs, Gloo on CPUs
(not implemented yet, issue #6). Kept light: importing this package does not import torch.
"""
