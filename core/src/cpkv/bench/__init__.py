"""Benchmarks behind ``cpkv bench``: each writes a JSON report of rows measured against a
baseline or ceiling taken in the same run."""

from .report import BenchReport, BenchRow, card_name, machine_description, results_name

__all__ = ["BenchReport", "BenchRow", "card_name", "machine_description", "results_name"]
