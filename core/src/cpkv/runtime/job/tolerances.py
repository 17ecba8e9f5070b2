"""How closely the CP run must agree with the one-rank reference: the job's tolerances, in one
place (the verdict, :meth:`~cpkv.runtime.job.report.JobReport.verdict`, and the top-k comparison
of :func:`~cpkv.runtime.job.run.run_job` read them)."""

from __future__ import annotations

from dataclasses import dataclass

from cpkv.contracts import KVDtype

__all__ = ["BF16_COMPUTE_TOLERANCE", "DEFAULT_TOLERANCES", "Tolerances"]

#: on GPUs the model computes in bfloat16 (8 mantissa bits), and a CP rank's matmuls over its
#: rows round differently from one GPU's over all rows: logits and indexer scores agree to this
#: (relative) accuracy
BF16_COMPUTE_TOLERANCE = 3e-2


@dataclass(frozen=True)
class Tolerances:
    """Largest accepted differences of the CP run from the reference.

    CP vs one rank runs the same model and pool format, so only row-batching rounding differs;
    an fp8 pool can turn an ulp into one quantisation step.
    """

    #: relative logit error per pool format (``kv.dtype``) on CPUs (a float32 model)
    fp32: float = 1e-4
    bf16: float = 1e-3
    fp8: float = 2e-2
    #: on GPUs (a bfloat16 model) at least this, whatever the pool format
    bf16_compute: float = BF16_COMPUTE_TOLERANCE
    #: top-k keys whose indexer score is this close (relative to the row's scale) to the k-th
    #: count as ties on CPUs (float32); on GPUs ``bf16_compute``
    tie_cpu: float = 1e-6

    def logits(self, kv_dtype: KVDtype | str, device: str) -> float:
        """Largest accepted relative logit error (last-token logits, and the MTP draft layer's)
        of CP vs the one-rank reference, for a ``kv_dtype`` pool on ``device``."""
        tol = {KVDtype.FP32: self.fp32, KVDtype.BF16: self.bf16,
               KVDtype.FP8: self.fp8}[KVDtype(kv_dtype)]
        return tol if device == "cpu" else max(tol, self.bf16_compute)

    def tie(self, device: str) -> float:
        """The relative score gap under which two top-k keys tie, on ``device``."""
        return self.tie_cpu if device == "cpu" else self.bf16_compute


DEFAULT_TOLERANCES = Tolerances()
