"""Test helpers shipped with cpkv so that plugin authors can reuse them.

``cpkv.testing.strategies`` needs hypothesis (a test dependency, not a runtime one).
"""
