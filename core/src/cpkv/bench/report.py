"""The benchmark result schema: ``{"machine", "command", "results": [row, ...]}``."""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Self

from pydantic import Field, model_validator

from cpkv.contracts import Contract

__all__ = ["BenchReport", "BenchRow", "card_name", "machine_description", "results_name"]


class BenchRow(Contract):
    """One measurement and the baseline it is compared with (``ratio = value / baseline``)."""

    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float = Field(gt=0)
    ratio: float

    @model_validator(mode="after")
    def _ratio_matches(self) -> Self:
        want = self.value / self.baseline_value
        if abs(self.ratio - want) > 1e-6 * max(1.0, abs(want)):
            raise ValueError(f"{self.name}: ratio={self.ratio} but value/baseline={want}")
        return self

    @classmethod
    def of(cls, name: str, value: float, unit: str, baseline_name: str,
           baseline_value: float) -> BenchRow:
        return cls(name=name, value=value, unit=unit, baseline_name=baseline_name,
                   baseline_value=baseline_value, ratio=value / baseline_value)


class BenchReport(Contract):
    machine: str
    command: str
    results: tuple[BenchRow, ...]
    #: raw timings and settings behind the rows (free-form)
    detail: dict[str, Any] = Field(default_factory=dict)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as indented JSON (parents created); returns the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        tmp.replace(p)  # never leave a half-written report
        return p


def machine_description() -> str:
    """CPU model, core count and Python/torch versions (GPU name when one is visible)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"{cpu} x{os.cpu_count()}", f"Python {sys.version.split()[0]}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}")
    except ImportError:
        pass
    return ", ".join(parts)


def card_name(gpus: int = 1, device_name: str | None = None) -> str:
    """The short name of the machine a bench ran on, for its report's file name: ``cpu`` without
    a CUDA device, else the GPU's model token in lower case (the first word of the device name
    that mixes letters and digits, e.g. ``a100``), with ``x<gpus>`` when the bench used several.
    ``device_name`` stands in for ``torch.cuda.get_device_name(0)``."""
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        device_name = torch.cuda.get_device_name(0)
    words = re.findall(r"[A-Za-z0-9]+", device_name)
    model = next((w for w in words if re.search(r"[A-Za-z]", w) and re.search(r"[0-9]", w)
                  and not re.fullmatch(r"[0-9]+[GMT]B", w, re.I)), words[-1] if words else "gpu")
    return model.lower() + (f"x{gpus}" if gpus > 1 else "")


def results_name(bench: str, gpus: int = 1, device_name: str | None = None) -> str:
    """``benchmarks/results/<bench>_<card>.json``: where a bench's report goes by default
    (:func:`card_name`)."""
    return f"benchmarks/results/{bench}_{card_name(gpus, device_name)}.json"
