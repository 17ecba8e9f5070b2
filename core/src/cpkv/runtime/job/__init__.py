"""The main job (``cpkv run``): CP prefill of prompts on C rank processes, the transfer of their
pages to a non-CP decode rank and greedy decoding there (C + 1 processes in one world), the same
prompts on one rank as the reference (prefill and greedy generation), and a report (KV bytes per
rank vs a replica, transfer bytes per rank, time per phase, fallbacks, correctness).

Each role is its own module and uses the library API an engine embeds:
:mod:`.prefill_rank` (:class:`~cpkv.runtime.session.PrefillSession`, its ``connect`` and
``send``), :mod:`.decode_rank` (:class:`~cpkv.runtime.decode.DecodeSession`), :mod:`.reference`;
:mod:`.results` holds what they hand back, :mod:`.sections` the report's sections built from it,
:mod:`.report` the job's report and its verdict (:mod:`.tolerances`: how closely CP must agree);
:mod:`.run` puts them together.
"""

from .decode_rank import decode_rank
from .prefill_rank import prefill_rank, prefill_sender_rank
from .reference import reference_rank
from .report import Check, JobReport, Verdict
from .results import DecodeReport, RankReport, SenderReport, compare_topk
from .run import JobPlacement, disagg_rank, job_placement, run_job
from .spec import JobSpec
from .tolerances import DEFAULT_TOLERANCES, Tolerances

__all__ = [
           "DEFAULT_TOLERANCES",
           "Check",
           "DecodeReport",
           "JobPlacement",
           "JobReport",
           "JobSpec",
           "RankReport",
           "SenderReport",
           "Tolerances",
           "Verdict",
           "compare_topk",
           "decode_rank",
           "disagg_rank",
           "job_placement",
           "prefill_rank",
           "prefill_sender_rank",
           "reference_rank",
           "run_job",
]
