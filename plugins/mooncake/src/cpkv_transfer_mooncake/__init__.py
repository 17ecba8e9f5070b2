"""cpkv KV transfer over the Mooncake Transfer Engine (one-sided writes into the decode pool).

Kept light: importing this package imports neither torch nor mooncake (the transport is in
``transport``; ``plugin.load()`` imports the engine, then the transport, and hands it the
engine class).
"""
