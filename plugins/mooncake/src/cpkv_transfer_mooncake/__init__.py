"""cpkv KV transfer over the Mooncake Transfer Engine (not implemented yet, issue #6).

Kept light: importing this package does not import mooncake.
"""
