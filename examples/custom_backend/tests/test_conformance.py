"""The example backend's conformance tests: cpkv's base test classes, subclassed.

Run with the example installed (``pip install -e examples/custom_backend``)::

    pytest examples/custom_backend/tests
"""

from __future__ import annotations

from cpkv_example_backend.ops import ExampleOps
from cpkv_example_backend.plugin import OPS

from cpkv.testing.conformance import BasePageOpsTests


class TestExampleOps(BasePageOpsTests):
    """Its one op (``rerange``) against the torch reference; the other page ops are skipped
    (the backend does not provide them: ``OPS`` says so)."""

    ops = ExampleOps()
    provides = OPS
    seeds = (0, 1)
