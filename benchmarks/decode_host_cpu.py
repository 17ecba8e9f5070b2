"""Host time of decode steps on a CPU: one-token extends through ``PrefillSession.prefill``, as
``cpkv.bench.gpu.decode_steps`` runs them on a GPU (one rank, fp8 pool, part-major pages), on a
small checkpoint so that the step's time is mostly the driver's host work.

    python -m cpkv init-model /tmp/dec/tiny2 --layers 2 --dense-layers 2 --no-mtp
    python benchmarks/decode_host_cpu.py /tmp/dec/tiny2 --tokens 3072 --steps 50 [--profile tottime]
        [--save out.pt]   # the steps' logits and top-k, to compare two versions bit for bit
    python benchmarks/decode_host_cpu.py /tmp/dec/tiny2 --per-batch 65536
        # a decode step's per-batch host work alone (plan, prepare + abort, rank inputs) over a
        # context of that many tokens (its pages are adopted, nothing is computed)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from cpkv.comm import CPGroup
from cpkv.models import load_model
from cpkv.runtime.session import PrefillSession
from cpkv.settings import load_settings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", choices=("cumulative", "tottime"), default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--save", default=None)
    ap.add_argument("--per-batch", type=int, default=0, metavar="CONTEXT")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    model = load_model(args.model_dir, dtype=torch.bfloat16, device=dev)
    settings = load_settings(cp={"size": 1},
                             kv={"dtype": "fp8", "page_size": 64, "layout": "part_major",
                                 "pages_per_rank": max(args.tokens, args.per_batch) // 64 + 64},
                             backend={"preference": ["torch"]})
    session = PrefillSession(model, settings, CPGroup.single(dev))
    if args.per_batch:
        per_batch(session, args.per_batch, args.steps)
        return
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (args.tokens + 2 * args.steps + 8,),
                        generator=g).tolist()
    session.prefill([("d", ids[: args.tokens])])
    nxt = args.tokens
    saved: list[tuple[torch.Tensor, list[torch.Tensor]]] = []

    def step(capture: bool = False) -> None:
        nonlocal nxt
        res = session.prefill([("d", [ids[nxt]])], capture_topk=capture)
        res.last_logits.argmax().item()  # the next token is read back, as a decode loop does
        nxt += 1
        if args.save:
            saved.append((res.last_logits.clone(),
                          [t.clone() for t in res.topk.indices] if res.topk is not None else []))

    for _ in range(3):  # warm-up
        step(args.save is not None)
    times, cpu = [], []  # wall time, and this thread's CPU time (steadier on a shared machine)
    for i in range(args.steps):
        t, c = time.perf_counter(), time.thread_time()
        step(args.save is not None and i % 10 == 0)
        times.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    print(f"decode step host time (CPU, median of {args.steps}): "
          f"{1e3 * statistics.median(times):.3f} ms  (min {1e3 * min(times):.3f}, "
          f"max {1e3 * max(times):.3f}); thread CPU time {1e3 * statistics.median(cpu):.3f} ms "
          f"(min {1e3 * min(cpu):.3f}); ops {dict(session.ops.chosen)}")
    calls, ops = _count(step)
    print(f"one step: {calls} Python function calls, {ops} torch ops dispatched")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats(args.profile).print_stats(args.top)
    if args.save:
        torch.save(saved, args.save)


def _count(step: Callable[[], None]) -> tuple[int, int]:
    """Python function calls (cProfile) and aten ops (a dispatch mode) of one ``step()``: the
    host work a step does, counted (steady where timings on a shared machine are not)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())  # type: ignore[attr-defined]
    with Ops():
        step()
    return calls, Ops.n


def per_batch(session: PrefillSession, context: int, steps: int) -> None:
    """Median and min of the per-batch host work of one-token extends after ``context`` tokens."""
    pool, driver = session.pool, session.driver
    n = -(-context // 64)
    pages = [(0, s) for s in pool.pages.take_pages([n], "the context")[0]]
    pool.pages.adopt("d", pages, context)
    pool.pages.release(pages)  # the request holds them now
    batch = [("d", [1])]
    parts: dict[str, list[float]] = {"plan": [], "prepare": [], "rank_inputs": [], "total": []}
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        plan = driver.plan(batch)
        t1 = time.perf_counter()
        kv = pool.prepare(plan, ["d"])
        t2 = time.perf_counter()
        driver._rank_inputs(plan, kv, batch)
        t3 = time.perf_counter()
        pool.abort(kv)
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            parts[k].append(v)
    print(f"per-batch host work of a one-token extend after {context} tokens (median / min of "
          f"{steps}, ms): " + ", ".join(f"{k} {1e3 * statistics.median(v[3:]):.3f} / "
                                         f"{1e3 * min(v[3:]):.3f}" for k, v in parts.items()))


if __name__ == "__main__":
    main()
