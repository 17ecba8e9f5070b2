"""Benchmarks behind ``cpkv bench``: each writes a JSON report of rows measured against a
baseline or ceiling taken in the same run."""

from .report import BenchReport, BenchRow, machine_description

__all__ = ["BenchReport", "BenchRow", "machine_description"]
