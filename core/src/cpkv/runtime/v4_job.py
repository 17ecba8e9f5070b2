"""The DeepSeek-V4 job behind ``cpkv run --model DIR`` for a ``deepseek_v4`` checkpoint: CP
prefill of the prompts as one batch on Gloo ranks, or NCCL ranks on GPUs
(:func:`~cpkv.runtime.v4_prefill.v4_prefill_batch`, chunked when asked; the ``v4_*`` ops from
the backend preference through the registry: the torch reference, the Triton and CUDA backends
passing them on visibly), the one-rank forward on the CPU as the reference, and the KV bytes per
rank against the replicated entries plus the tail objects.

Decode after the prefill is not built for V4: the job runs the prefill phase only.

With decode tokens the job is disaggregated (a world of C + 1 Gloo processes, on the CPU): after each
prompt's prefill every CP rank sends the compressed entries it owns and the last token's rank the
tail bundle (:mod:`cpkv.runtime.v4_transfer`, over the selected transfer plugin); the decode rank
publishes the request once every part arrived, assembles its decode state and decodes greedily
(:mod:`cpkv.runtime.v4_decode`). The reference: the one-rank forward over prompt + decoded
tokens, whose argmax at each position must be the next decoded token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackEvent, SplitMode
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.v4_objects import v4_objects
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import OpTable, v4_op_table

from .job.run import job_placement
from .launch import run_ranks
from .v4_decode import v4_greedy
from .v4_prefill import V4Carry, V4Layout, v4_kv_bytes, v4_layout, v4_prefill_batch
from .v4_state import owned_entries, tail_bundle
from .v4_transfer import V4StateReceiver, V4StateSender

if TYPE_CHECKING:
    from cpkv.disagg import Transport
    from cpkv.disagg.v4_bundle import V4Image, V4Shapes
    from cpkv.settings import Settings

__all__ = ["V4JobReport", "V4OpsChoice", "chunk_sizes", "decode_requests", "reference_outputs",
           "run_v4_job"]

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

    def rel_diff(self) -> list[float]:
        """Per prompt ``max |cp - ref| / max |ref|`` of the last-position logits."""
        return [float((a - b).abs().max() / b.abs().max())
                for a, b in zip(self.logits, self.reference, strict=True)]

    def argmax_equal(self) -> list[bool]:
        return [int(a.argmax()) == int(b.argmax())
                for a, b in zip(self.logits, self.reference, strict=True)]

    def tokens_equal(self) -> list[bool]:
        return [a == b for a, b in zip(self.tokens, self.reference_tokens, strict=True)]

    def passed(self, tolerance: float = 2e-3) -> bool:
        return (all(d <= tolerance for d in self.rel_diff()) and all(self.argmax_equal())
                and all(self.tokens_equal()))


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
                 ) -> tuple[torch.Tensor, list[int]] | tuple[list[list[int]], list[int]]:
    """One process of the disaggregated V4 job (a world of C + 1): ranks 0..C-1 prefill on
    their CP group and send their parts of each request's decode state; rank C receives,
    assembles and decodes. Prefill ranks return ``(last logits, bytes sent per prompt)``, the
    decode rank ``(tokens per prompt, tail bundle bytes per prompt)``."""
    from cpkv.disagg import select_transport
    from cpkv.disagg.v4_bundle import V4Image, V4Shapes

    c = world.size - 1
    cp_pg = dist.new_group(list(range(c)), timeout=timedelta(seconds=world.timeout_s))
    model = DeepseekV4.load(ckpt, ops=choice.table(world))
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
            first = int(x[-1].argmax())
            sent.append(tx.send(shapes, image, owned_entries(model, carry, group.rank),
                                tail_bundle(model, carry), {"first_token": first}).nbytes)
    tx.close()
    world.barrier()  # the decode rank keeps the side channel's store until every ack was read
    return torch.stack([x[-1] for x in logits]), sent


def decode_requests(world: CPGroup, model: DeepseekV4, shapes: V4Shapes, images: list[V4Image],
                    transport: Transport, settings: Settings, decode_tokens: int
                    ) -> tuple[list[list[int]], list[int]]:
    """The decode rank of a disaggregated V4 job (the world's last): receive each request's
    decode state as ``images`` plan it, decode ``decode_tokens`` greedy tokens from the first
    token the prefill sent; ``(tokens per request, tail bundle bytes per request)``."""
    c = world.size - 1
    pages = max(im.first_pages()[-1] + im.pages(im.tail_bytes) for im in images)
    rx = V4StateReceiver(transport, settings, c, pages)
    tokens, bundles = [], []
    with torch.no_grad():
        for _ in images:
            state, got = rx.receive(shapes)
            bundles.append(got.meta["v4_image"].tail_bytes)
            tokens.append(v4_greedy(model, state, int(got.meta["first_token"]), decode_tokens))
    world.barrier()  # the store the side channel runs on is ours: every sender has its acks
    rx.close()
    return tokens, bundles


def _rank(group: CPGroup, ckpt: str, prompts: list[list[int]], page_size: int, mode: str,
          chunk: int, choice: V4OpsChoice) -> torch.Tensor:
    model = DeepseekV4.load(ckpt, device=group.device, ops=choice.table(group))
    with torch.no_grad():  # the prompts as one batch (one halo and one full view a layer)
        logits = v4_prefill_batch(model, [torch.tensor(p, dtype=torch.long) for p in prompts],
                                  group, page_size=page_size, mode=mode,
                                  chunks=[chunk_sizes(len(p), chunk) for p in prompts])
    return torch.stack([x[-1] for x in logits]).cpu()


def reference_outputs(model: DeepseekV4, prompts: list[list[int]], tokens: list[list[int]]
                      ) -> tuple[torch.Tensor, list[list[int]]]:
    """The one-rank reference of a V4 job: per prompt the last position's logits ``[prompts,
    vocab]`` and, with decoded ``tokens``, the forward's argmax after each prefix of them. One
    forward over prompt + tokens gives both (it is causal, and each row's bits do not depend on
    the rows after it)."""
    last, picks = [], []
    with torch.no_grad():
        for j, p in enumerate(prompts):
            toks = tokens[j] if tokens else []
            out = reference_forward(model, torch.tensor(p + toks, dtype=torch.long))
            last.append(out[len(p) - 1])
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
    model = DeepseekV4.load(ckpt, ops=v4_op_table())  # the reference: the torch ops on the CPU
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
        tail += sum(o.bytes_for(len(p)) for o in v4_objects(model.config) if o.kind != "entries")
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
        tokens, bundles = results[cp].value
        sent = [sum(r.value[1]) for r in results[:cp]]
    else:
        results = run_ranks(_rank, cp, args=(ckpt, prompts, page_size, mode, chunk, choice),
                            timeout_s=timeout_s, backend=place.backend, gpus=place.gpus)
        logits = results[0].value
    seconds = time.perf_counter() - t0
    ref, ref_tokens = reference_outputs(model, prompts, tokens)
    return V4JobReport(lengths=[len(p) for p in prompts], logits=logits, reference=ref,
                       rank_bytes=per, entry_bytes=entries, tail_bytes=tail, seconds=seconds,
                       fallbacks=list(results[0].fallbacks), tokens=tokens,
                       reference_tokens=ref_tokens, bytes_sent=sent, bundle_bytes=bundles)
