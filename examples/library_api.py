"""Drive cpkv from Python the way an engine embeds it: one PrefillSession per CP rank.

Run:  python examples/library_api.py   (two CPU rank processes over Gloo, the tiny model)

Each rank loads the model, creates a session (ops agreed across ranks, startup checks, the
sharded KV pool), prefills a batch, then continues one request from its cached prefix, which
ends inside a page. Rank 0 prints the logits it got and where the KV pages live.
"""

from __future__ import annotations

import cpkv


def rank_main(group: cpkv.CPGroup, settings: cpkv.Settings) -> dict:
    model = cpkv.load_model(settings.run.model)
    session = cpkv.PrefillSession(model, settings, group)
    prompt_a = [t % 500 for t in range(1, 601)]  # 600 tokens
    prompt_b = [7, 8, 9] * 30  # 90 tokens: fewer than 2C pages, the visible short-extend fallback
    first = session.prefill([("a", prompt_a[:330]), ("b", prompt_b)])
    # "a" continues from its 330 cached tokens (330 is not a multiple of the 64-token page)
    second = session.prefill([("a", prompt_a[330:])])
    pages = session.pages("a")
    return {
        "rank": group.rank,
        "plan_first": [(s.start, s.end, s.rank) for s in first.plan.requests[0].segments],
        "head_fragment": second.plan.requests[0].segments[0],
        "logits_a": second.last_logits[0, :5].tolist(),
        "owners_a": pages.owners,
        "kv_bytes": session.pool.footprint().bytes_held,
        "kv_bytes_replicated": session.pool.footprint().replicated_bytes,
    }


def main() -> None:
    settings = cpkv.load_settings(cp={"size": 2})
    results = cpkv.run_ranks(rank_main, settings.cp.size, args=(settings,), timeout_s=300)
    r0 = results[0].value
    print("first batch, request a segments [start, end, rank]:", r0["plan_first"])
    print("second batch starts with the head fragment on the tail page's owner:",
          r0["head_fragment"])
    print("owner of each page of request a:", r0["owners_a"])
    for r in results:
        v = r.value
        print(f"rank {v['rank']}: {v['kv_bytes']:,} KV bytes "
              f"({v['kv_bytes'] / v['kv_bytes_replicated']:.0%} of a replica)")
    print("last-token logits of request a (first 5):", [round(x, 4) for x in r0["logits_a"]])
    print("fallbacks on rank 0:", [f"{e.op}: {e.reason.value}" for e in results[0].fallbacks])


if __name__ == "__main__":
    main()
