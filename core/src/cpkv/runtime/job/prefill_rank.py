"""The job's prefill ranks: CP prefill alone, or CP prefill that hands each request to the decode
rank through :meth:`PrefillSession.send` (the library API an engine calls)."""

from __future__ import annotations

from cpkv.comm import CPGroup
from cpkv.disagg import Sent, page_checksums, select_transport

from ..decode import greedy
from ..prefill import PrefillResult
from .results import RankReport, SenderReport, rank_report
from .spec import JobSpec, open_session, prefill_batches

__all__ = ["prefill_rank", "prefill_sender_rank"]


def prefill_rank(group: CPGroup, spec: JobSpec) -> RankReport:
    """One rank of the CP group: load the model, prefill the prompts (cached prefixes first)."""
    session, load_s = open_session(group, spec)
    return rank_report(group, session, prefill_batches(session, spec), load_s)


def prefill_sender_rank(world: CPGroup, group: CPGroup, spec: JobSpec) -> SenderReport:
    """A prefill rank of the disaggregated job: CP prefill on ``group`` (endpoint
    ``group.rank``), sending each request's pages after the batch that computed them: the whole
    pages after a non-final chunk, the rest after the final one, with the first greedy token.
    ``world`` (the C prefill ranks and the decode rank) agrees on the transfer plugin."""
    s = spec.settings
    session, load_s = open_session(group, spec)
    session.connect(select_transport(s, world.agree_all))
    rids = spec.rids
    sent: list[Sent] = []
    crcs: dict[str, dict[int, int]] = {}

    def send(batch: list[tuple[int, bool]], res: PrefillResult) -> None:
        sent.extend(session.chunk_sends)  # a chunked prefill's non-final chunks, sent in it
        # every page of the request moves, cached prefix pages too (each from its owner)
        drafts = greedy(res.draft_logits) if res.draft_logits is not None else None
        for j, ((i, final), tok) in enumerate(zip(batch, greedy(res.last_logits), strict=True)):
            meta: dict[str, int] = {}
            if final:  # the first token, and with the draft layer its guess of the next one
                meta = {"first_token": tok} | ({"draft_token": drafts[j]} if drafts else {})
            sent.append(session.send(rids[i], final=final, meta=meta))
            if s.debug and final:  # before the request is finished into the cache
                rp = session.pages(rids[i])
                mine = [k for k, o in enumerate(rp.owners) if o == group.rank]
                sums = page_checksums(session.pool.store, [rp.slots[k] for k in mine])
                crcs[rids[i]] = dict(zip(mine, sums, strict=True))

    served = prefill_batches(session, spec, send, sending=True)
    session.close()
    world.barrier()  # the decode rank keeps the side channel's store until every ack was read
    return SenderReport(prefill=rank_report(group, session, served, load_s),
                        bytes_sent=sum(d.nbytes for d in sent), entries=sum(d.entries for d in sent),
                        seconds=sum(d.seconds for d in sent),
                        manifests=[d.manifest for d in sent],
                        page_crcs=crcs, pipeline=s.transfer.pipeline,
                        ready_seconds=[d.ready_seconds for d in sent],
                        overlap_seconds=sum(d.overlap_seconds for d in sent),
                        send_seconds=sum(d.send_seconds for d in sent))
