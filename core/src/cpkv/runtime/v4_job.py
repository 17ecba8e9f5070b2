"""The DeepSeek-V4 job behind ``cpkv run --model DIR`` for a ``deepseek_v4`` checkpoint: CP
prefill of the prompts as one batch on Gloo ranks, or NCCL ranks on GPUs
(:func:`~cpkv.runtime.v4_prefill.v4_prefill_batch`, chunked when asked; the ``v4_*`` ops from
the backend preference through the registry: the torch reference, the Triton and CUDA backends
passing them on visibly), the one-rank forward on the CPU as the reference, and the KV bytes per
rank against the replicated entries plus the tail objects.

With ``run.mtp`` the checkpoint's MTP draft layer runs under the CP prefill (its window rows
are tail objects; its last-position logits are checked against the one-rank MTP forward) and the
decode rank decodes speculatively (:mod:`cpkv.runtime.v4_speculative`: the tokens must still be
the one-rank forward's greedy ones).

With decode tokens the job is disaggregated (a world of C + 1 Gloo processes, on the CPU): after each
prompt's prefill every CP rank sends the compressed entries it owns and the last token's rank the
tail bundle (:mod:`cpkv.runtime.v4_transfer`, over the selected transfer plugin); the decode rank
publishes the request once every part arrived, assembles its decode state and decodes greedily
(:mod:`cpkv.runtime.v4_decode`). The reference: the one-rank forward over prompt + decoded
tokens, whose argmax at each position must be the next decoded token.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackEvent, FallbackReason, SplitMode
from cpkv.fallback import report_fallback
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.v4_objects import v4_objects
from cpkv.models.v4_reference import reference_draft, reference_forward
from cpkv.ops import OpTable, v4_op_table

from .job.run import job_placement
from .launch import run_ranks
from .v4_decode import v4_greedy
from .v4_prefill import V4Carry, V4Layout, v4_kv_bytes, v4_layout, v4_prefill_batch
from .v4_speculative import V4SpeculationStats, v4_speculative
from .v4_state import owned_entries, tail_bundle
from .v4_transfer import V4StateReceiver, V4StateSender

if TYPE_CHECKING:
    from cpkv.disagg import Transport
    from cpkv.disagg.v4_bundle import V4Image, V4Shapes
    from cpkv.settings import Settings

__all__ = [
    "V4JobReport",
    "V4OpsChoice",
    "chunk_sizes",
    "decode_requests",
    "kv_dtype_fallback",
    "reference_outputs",
    "reference_plan",
    "run_v4_job",
    "split_drafts",
]

def chunk_sizes(length: int, chunk: int) -> list[int]:
    """Pieces of at most ``chunk`` tokens (0: one piece)."""
    if chunk <= 0 or length <= chunk:
        return [length]
    return [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])


@dataclass
class V4JobReport:
    """What the V4 job measured."""

    lengths: list[int]
    logits: torch.Tensor  # [prompts, vocab] float32: CP, last position
    reference: torch.Tensor  # [prompts, vocab] float32: one rank, last position
    rank_bytes: list[int]  # per rank, summed over the prompts
    entry_bytes: int  # every compressed entry once
    tail_bytes: int  # the tail objects (window rows, carry state)
    seconds: float
    fallbacks: list[FallbackEvent] = field(default_factory=list)
    #: with decode: per prompt the decoded tokens (the first from the prefill), the one-rank
    #: reference's argmax after each prefix of them, the bytes each prefill rank sent and the
    #: tail bundle's bytes
    tokens: list[list[int]] = field(default_factory=list)
    reference_tokens: list[list[int]] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    bundle_bytes: list[int] = field(default_factory=list)
    #: with the MTP layer: its last-position logits per prompt, CP and one rank, and with
    #: decode the speculation's verify steps, drafts and accepted drafts (summed)
    draft_logits: torch.Tensor | None = None
    draft_reference: torch.Tensor | None = None
    speculation: V4SpeculationStats | None = None

    #: per prompt whether the one-rank reference checked it (``run.reference``: all with
    #: "full", those of at most ``reference_tokens`` tokens with "sample", none with "off";
    #: empty: all)
    checked: list[bool] = field(default_factory=list)

    def is_checked(self, i: int) -> bool:
        return not self.checked or self.checked[i]

    @property
    def any_checked(self) -> bool:
        return not self.checked or any(self.checked)

    @staticmethod
    def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max())

    def rel_diff(self) -> list[float]:
        """Per prompt ``max |cp - ref| / max |ref|`` of the last-position logits (NaN where
        not checked)."""
        return [self._rel(a, b) if self.is_checked(i) else float("nan")
                for i, (a, b) in enumerate(zip(self.logits, self.reference, strict=True))]

    def draft_rel_diff(self) -> list[float]:
        """The same of the MTP layer's last-position logits (none without it)."""
        if self.draft_logits is None or self.draft_reference is None:
            return []
        return [self._rel(a, b) if self.is_checked(i) else float("nan")
                for i, (a, b) in enumerate(zip(self.draft_logits, self.draft_reference,
                                               strict=True))]

    def argmax_equal(self) -> list[bool | None]:
        """Per prompt whether the argmax agrees (None where not checked)."""
        return [int(a.argmax()) == int(b.argmax()) if self.is_checked(i) else None
                for i, (a, b) in enumerate(zip(self.logits, self.reference, strict=True))]

    def tokens_equal(self) -> list[bool | None]:
        """Per prompt whether the decoded tokens are the reference's (None where not checked)."""
        return [a == b if self.is_checked(i) else None
                for i, (a, b) in enumerate(zip(self.tokens, self.reference_tokens, strict=True))]

    def passed(self, tolerance: float = 2e-3) -> bool:
        """Every checked prompt within ``tolerance``, argmax and tokens equal (True when none
        is checked: see :attr:`any_checked`)."""
        diffs = [d for d in self.rel_diff() + self.draft_rel_diff() if d == d]  # not NaN
        return (all(d <= tolerance for d in diffs)
                and all(x is not False for x in self.argmax_equal() + self.tokens_equal()))


@dataclass(frozen=True)
class V4OpsChoice:
    """Where a rank's ``v4_*`` ops come from: the backend preference, whether it is the
    default order (``backend.name = "auto"``: passing a backend over is not a fallback), and
    the ``plugins.disable`` / ``plugins.allow`` filters."""

    preference: tuple[str, ...] = ("torch",)
    quiet: bool = False
    disable: tuple[str, ...] = ()
    allow: tuple[str, ...] | None = None

    @classmethod
    def of(cls, settings: Settings) -> V4OpsChoice:
        allow = settings.plugins.allow
        return cls(tuple(settings.backend.effective_preference()),
                   settings.backend.name == "auto", tuple(settings.plugins.disable),
                   None if allow is None else tuple(allow))

    def table(self, group: CPGroup) -> OpTable:
        """The op table, agreed across ``group``'s ranks, for its device."""
        return v4_op_table(self.preference, agree=group.agree_all,
                           device_type=group.device.type, quiet=self.quiet,
                           disable=self.disable, allow=self.allow)


def _layouts(model: DeepseekV4, length: int, cp: int, page_size: int, mode: str,
             chunk: int) -> V4Layout:
    lay = None
    for n in chunk_sizes(length, chunk):
        lay = v4_layout(model, n, cp, page_size, mode, prefix=lay)
    assert lay is not None
    return lay


def _disagg_rank(world: CPGroup, ckpt: str, prompts: list[list[int]], page_size: int,
                 mode: str, chunk: int, decode_tokens: int, settings: Settings,
                 choice: V4OpsChoice
                 ) -> (tuple[torch.Tensor, list[int]]
                       | tuple[list[list[int]], list[int], V4SpeculationStats | None]):
    """One process of the disaggregated V4 job (a world of C + 1): ranks 0..C-1 prefill on
    their CP group and send their parts of each request's decode state; rank C receives,
    assembles and decodes. Prefill ranks return ``(last logits, bytes sent per prompt)``, the
    decode rank ``(tokens per prompt, tail bundle bytes per prompt)``."""
    from cpkv.disagg import select_transport
    from cpkv.disagg.v4_bundle import V4Image, V4Shapes

    c = world.size - 1
    cp_pg = dist.new_group(list(range(c)), timeout=timedelta(seconds=world.timeout_s))
    model = DeepseekV4.load(ckpt, ops=choice.table(world), mtp=settings.run.mtp)
    shapes = V4Shapes.of(model)
    transport = select_transport(settings, world.agree_all)
    images = []
    for i, p in enumerate(prompts):  # every endpoint plans the same images
        lay = _layouts(model, len(p), c, page_size, mode, chunk)
        images.append(V4Image.plan(str(i), shapes, lay.entries, len(p), lay.tail_rank))
    if world.rank == c:
        return decode_requests(world, model, shapes, images, transport, settings, decode_tokens)
    group = CPGroup.from_process_group(cp_pg, timeout_s=world.timeout_s, device=world.device)
    tx = V4StateSender(transport, settings, group, max(im.local_pages(group.rank)
                                                       for im in images))
    sent = []
    carries = [V4Carry() for _ in prompts]
    with torch.no_grad():  # the prompts as one batch, then each request's parts sent
        logits = v4_prefill_batch(model, [torch.tensor(p, dtype=torch.long) for p in prompts],
                                  group, page_size=page_size, mode=mode,
                                  chunks=[chunk_sizes(len(p), chunk) for p in prompts],
                                  carries=carries)
        for x, image, carry in zip(logits, images, carries, strict=True):
            meta = {"first_token": int(x[-1].argmax())} | first_draft_meta(carry)
            sent.append(tx.send(shapes, image, owned_entries(model, carry, group.rank),
                                tail_bundle(model, carry), meta).nbytes)
    tx.close()
    world.barrier()  # the decode rank keeps the side channel's store until every ack was read
    return _last(logits, carries), sent


def first_draft_meta(carry: V4Carry) -> dict[str, int]:
    """The meta of a request's first draft (the MTP layer's guess at the prompt's last row)."""
    return {"first_draft": int(carry.draft_logits[-1][-1].argmax())} if carry.draft_logits else {}


def _last(logits: list[torch.Tensor], carries: list[V4Carry]) -> torch.Tensor:
    """The last position's logits per prompt and, with the MTP layer, its draft logits after
    them: ``[prompts, vocab]`` or ``[prompts, 2, vocab]``."""
    last = torch.stack([x[-1] for x in logits])
    if not carries or not carries[0].draft_logits:
        return last
    return torch.stack([last, torch.stack([c.draft_logits[-1][-1] for c in carries])], dim=1)


def decode_requests(world: CPGroup, model: DeepseekV4, shapes: V4Shapes, images: list[V4Image],
                    transport: Transport, settings: Settings, decode_tokens: int
                    ) -> tuple[list[list[int]], list[int], V4SpeculationStats | None]:
    """The decode rank of a disaggregated V4 job (the world's last): receive each request's
    decode state as ``images`` plan it, decode ``decode_tokens`` greedy tokens from the first
    token the prefill sent (with the MTP layer: speculatively, ``run.draft_tokens`` drafts a
    step, from the first draft it sent); ``(tokens per request, tail bundle bytes per request,
    the speculation's counts or None)``."""
    c = world.size - 1
    pages = max(im.first_pages()[-1] + im.pages(im.tail_bytes) for im in images)
    rx = V4StateReceiver(transport, settings, c, pages)
    tokens, bundles = [], []
    total = V4SpeculationStats() if model.mtp_layer is not None else None
    with torch.no_grad():
        for _ in images:
            state, got = rx.receive(shapes)
            bundles.append(got.meta["v4_image"].tail_bytes)
            first = int(got.meta["first_token"])
            if total is None:
                tokens.append(v4_greedy(model, state, first, decode_tokens))
                continue
            toks, stats = v4_speculative(model, state, first, int(got.meta["first_draft"]),
                                         decode_tokens, settings.run.draft_tokens)
            tokens.append(toks)
            total.steps += stats.steps
            total.drafted += stats.drafted
            total.accepted += stats.accepted
    world.barrier()  # the store the side channel runs on is ours: every sender has its acks
    rx.close()
    return tokens, bundles, total


def _rank(group: CPGroup, ckpt: str, prompts: list[list[int]], page_size: int, mode: str,
          chunk: int, choice: V4OpsChoice, mtp: bool) -> torch.Tensor:
    model = DeepseekV4.load(ckpt, device=group.device, ops=choice.table(group), mtp=mtp)
    carries = [V4Carry() for _ in prompts]
    with torch.no_grad():  # the prompts as one batch (one halo and one full view a layer)
        logits = v4_prefill_batch(model, [torch.tensor(p, dtype=torch.long) for p in prompts],
                                  group, page_size=page_size, mode=mode,
                                  chunks=[chunk_sizes(len(p), chunk) for p in prompts],
                                  carries=carries)
    return _last(logits, carries).cpu()


def reference_outputs(model: DeepseekV4, prompts: list[list[int]], tokens: list[list[int]],
                      which: Sequence[bool] | None = None
                      ) -> tuple[torch.Tensor, list[list[int]]]:
    """The one-rank reference of a V4 job: per prompt the last position's logits ``[prompts,
    vocab]`` and, with decoded ``tokens``, the forward's argmax after each prefix of them. One
    forward over prompt + tokens gives both (it is causal, and each row's bits do not depend on
    the rows after it). A model with its MTP layer: ``[prompts, 2, vocab]``, the MTP layer's
    last-position logits second (its next token there: the forward's argmax)."""
    last, picks = [], []
    with torch.no_grad():
        for j, p in enumerate(prompts):
            toks = tokens[j] if tokens else []
            ids = torch.tensor(p + toks, dtype=torch.long)
            out = reference_forward(model, ids)
            row = out[len(p) - 1]
            if model.mtp_layer is not None:
                nxt = torch.cat([ids[1:len(p)], row.argmax()[None]])
                row = torch.stack([row, reference_draft(model, ids[:len(p)], nxt)[-1]])
            last.append(row)
            if tokens:
                picks.append(out[len(p) - 1: len(p) - 1 + len(toks)].argmax(-1).tolist())
    return torch.stack(last), picks


def run_v4_job(ckpt: str, prompts: list[list[int]], cp: int, mode: SplitMode | str,
               page_size: int, chunk: int = 0, timeout_s: float = 600.0, device: str = "cpu",
               ops: V4OpsChoice | None = None, *, decode_tokens: int = 0,
               settings: Settings | None = None) -> V4JobReport:
    """Prefill ``prompts`` on ``cp`` ranks and on one rank (the CPU); measure. With
    ``decode_tokens``: the disaggregated job on CPU ranks (``settings.transfer`` picks the
    plugin), each prompt decoded to that many tokens on the decode rank and checked against the
    one-rank forward.

    ``device``: ``run.device`` ("cpu": Gloo ranks; "cuda": NCCL ranks, rank r on GPU r;
    "auto": cuda when there is a GPU per rank); the model is float32 on either.
    ``ops``: where the ranks' ``v4_*`` ops come from (default: the torch backend).

    Raises:
        ValueError: a chunk that is not a multiple of the model's ownership unit, a window
            wider than the unit, "cuda" with fewer GPUs than ranks, decode tokens on "cuda".
    """
    place = job_placement(device, cp, decode=False)
    if decode_tokens > 0 and place.backend != "gloo":
        raise ValueError(f"run.decode_tokens = {decode_tokens}: DeepSeek-V4 decode runs on CPU "
                         "ranks only; use --device cpu, or --decode-tokens 0 on cuda")
    choice = ops or V4OpsChoice()
    mtp = settings is not None and settings.run.mtp
    dtype_events = kv_dtype_fallback(settings)
    # the reference: the torch ops on the CPU
    model = DeepseekV4.load(ckpt, ops=v4_op_table(), mtp=mtp)
    unit = model.config.ownership_unit(page_size)
    if chunk and chunk % unit:
        raise ValueError(f"runtime.chunk_tokens = {chunk}: DeepSeek-V4 chunks end on ownership "
                         f"units of {unit} tokens (lcm of kv.page_size = {page_size} and the "
                         f"compress rates {list(model.config.rates)}); use a multiple of {unit}")
    mode = SplitMode(mode).value
    per = [0] * cp
    entries = tail = 0
    for p in prompts:  # host-side: the plan layouts, checked before any rank starts
        lay = _layouts(model, len(p), cp, page_size, mode, chunk)
        ranks, rep = v4_kv_bytes(model, lay)
        per = [a + b for a, b in zip(per, ranks, strict=True)]
        entries += rep
        tail += sum(o.bytes_for(len(p)) for o in v4_objects(model.config, mtp=mtp)
                    if o.kind != "entries")
    t0 = time.perf_counter()
    tokens: list[list[int]] = []
    sent: list[int] = []
    bundles: list[int] = []
    if decode_tokens > 0:
        if settings is None:
            from cpkv.settings import load_settings

            settings = load_settings()
        results = run_ranks(_disagg_rank, cp + 1, args=(ckpt, prompts, page_size, mode, chunk,
                                                        decode_tokens, settings, choice),
                            timeout_s=timeout_s)
        logits = results[0].value[0]
        tokens, bundles, spec = results[cp].value
        sent = [sum(r.value[1]) for r in results[:cp]]
    else:
        spec = None
        results = run_ranks(_rank, cp, args=(ckpt, prompts, page_size, mode, chunk, choice, mtp),
                            timeout_s=timeout_s, backend=place.backend, gpus=place.gpus)
        logits = results[0].value
    seconds = time.perf_counter() - t0
    which = reference_plan(prompts, decode_tokens, settings)
    ref, ref_tokens = reference_outputs(model, prompts, tokens, which)
    last, last_ref, drafts, drafts_ref = split_drafts(logits, ref)
    return V4JobReport(lengths=[len(p) for p in prompts], logits=last, reference=last_ref,
                       rank_bytes=per, entry_bytes=entries, tail_bytes=tail, seconds=seconds,
                       fallbacks=dtype_events + list(results[0].fallbacks), tokens=tokens,
                       reference_tokens=ref_tokens, bytes_sent=sent, bundle_bytes=bundles,
                       draft_logits=drafts, draft_reference=drafts_ref, speculation=spec,
                       checked=which)


def kv_dtype_fallback(settings: Settings | None) -> list[FallbackEvent]:
    """The fallback of a ``kv.dtype`` the V4 job cannot keep (anything but "auto" and fp32:
    its entries, window rows and carry state stay in the model's float32), reported once."""
    if settings is None or settings.kv.dtype in ("auto", "fp32"):
        return []
    return [report_fallback(
        op="v4_kv_dtype", requested=f"kv.dtype = {settings.kv.dtype}",
        selected="float32 (the model's dtype)", reason=FallbackReason.KV_DTYPE_UNAVAILABLE,
        detail="DeepSeek-V4's pools in bf16 / FP8 (584-B entries, 132-B index keys) are not "
               "built: the job keeps its entries, window rows and carry state as float32 "
               "tensors")]


def reference_plan(prompts: list[list[int]], decode_tokens: int, settings: Settings | None
                   ) -> list[bool]:
    """Which prompts the one-rank reference computes (``run.reference``): all ("full", or no
    settings), none ("off"), or with "sample" those whose prompt and decoded tokens fit in
    ``run.reference_tokens`` (a V4 prompt is checked whole or not at all)."""
    mode = settings.run.reference if settings is not None else "full"
    if mode == "off":
        return [False] * len(prompts)
    if mode == "full" or settings is None:
        return [True] * len(prompts)
    return [len(p) + decode_tokens <= settings.run.reference_tokens for p in prompts]


def split_drafts(logits: torch.Tensor, ref: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logits, reference, draft logits, draft reference)`` from the ranks' and the
    reference's last rows (``[P, vocab]``, or ``[P, 2, vocab]`` with the MTP layer's second)."""
    if logits.dim() == 2:
        return logits, ref, None, None
    return logits[:, 0], ref[:, 0], logits[:, 1], ref[:, 1]
