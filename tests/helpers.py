"""Helpers shared by several test modules (no test module imports another's names).

* Transfer tests (test_disagg, test_late_write, test_mooncake): :data:`PAGE`, a small bf16
  format, one-rank torch pools standing in for prefill ranks' shards (:class:`FakeRank`), a
  random page source, delivery to a :class:`~cpkv.disagg.DecodeReceiver` and the checks that
  pages landed at their logical positions; a job spec of the tiny model and its single-rank
  reference tokens.
* Process tests (test_job_behaviour, test_torchrun_signals): :func:`children`, :func:`alive`
  (from /proc).
* transformers comparisons (test_models, test_run_e2e): :data:`HF_TINY`, :func:`hf_random_model`,
  :func:`hf_logits`.
* CP ranks as threads of one process (test_v4_cp, test_v4_mtp): :class:`ThreadRanks`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat
from cpkv.disagg import DecodeReceiver, TransferManifest, manifest_for, pack_part, page_checksums
from cpkv.kv import KVStore, PageTable, RequestPages, ShardedKVPool
from cpkv.kv.buffers import read_part
from cpkv.ops import DSA_OPS
from cpkv.runtime.job import JobSpec
from cpkv.runtime.setup import resolve_ops
from cpkv.settings import load_settings

#: tokens per page of the transfer tests' pools
PAGE = 8


# ---- transfer: pools, sources, delivery --------------------------------------------------------
def small_format() -> KVFormat:
    return KVFormat(dtype="bf16", page_size=PAGE, kv_lora_rank=16, rope_dim=8, index_head_dim=8,
                    quant_block=8)


def torch_pool(group: CPGroup, capacity: int = 32, layers: int = 2) -> ShardedKVPool:
    s = load_settings(cp={"size": group.size}, backend={"preference": ["torch"]})
    ops, _ = resolve_ops(s, group, ops=DSA_OPS)
    return ShardedKVPool(small_format(), layers, group, ops, pages_per_rank=capacity)


def receiver_of(pool: ShardedKVPool, *, debug: bool = False) -> DecodeReceiver:
    """A receiver over ``pool``'s page table and store."""
    return DecodeReceiver(pool.pages, pool.store, debug=debug)


class FakeRank:
    """A prefill rank's pool: a one-rank pool stands in for rank r's shard (random bytes), of the
    format, layers and ops of the store ``like`` when given."""

    def __init__(self, seed: int, like: KVStore | None = None, capacity: int = 32) -> None:
        if like is None:
            self.pool = torch_pool(CPGroup.single(), capacity=capacity)
        else:
            self.pool = ShardedKVPool(like.fmt, like.num_layers, CPGroup.single(), like.ops,
                                      pages_per_rank=capacity)
        gen = torch.Generator().manual_seed(seed)
        for buf in (*self.pool.store.latent, *self.pool.store.index_k):
            buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))


def fake_source(c: int, n_pages: int, seed: int = 0, like: KVStore | None = None,
                ) -> tuple[list[FakeRank], list[int], list[int]]:
    rng = random.Random(seed)
    ranks = [FakeRank(seed * 10 + r, like) for r in range(c)]
    owners = [rng.randrange(c) for _ in range(n_pages)]
    nxt = [rng.randrange(3) for _ in range(c)]
    slots = []
    for o in owners:
        slots.append(nxt[o])
        nxt[o] += rng.choice([1, 1, 2])
    return ranks, owners, slots


def pool_snapshot(pages: PageTable) -> tuple[Any, ...]:
    return (pages.allocator.snapshot(),
            {k: (tuple(v.owners), tuple(v.slots), v.valid_len) for k, v in pages.requests.items()})


def deliver(rx: DecodeReceiver, ranks: list[FakeRank], m: TransferManifest,
             skip: int | None = None) -> dict[int, list[int]]:
    sums = {}
    for part in m.parts:
        src = [r.src_slot + i for r in part.runs for i in range(r.num_pages)]
        sums[part.rank] = page_checksums(ranks[part.rank].pool.store, src)
        if part.rank != skip:
            rx.place_packed(part, pack_part(ranks[part.rank].pool.store, part))
    return sums


def transfer_pages(rx: DecodeReceiver, ranks: list[FakeRank], owners: list[int],
                   slots: list[int], rid: str, valid: int, **kw: Any) -> bool:
    m = manifest_for(rid, RequestPages(owners, slots, valid), PAGE, len(ranks), **kw)
    rx.reserve(m)
    return rx.complete(m, deliver(rx, ranks, m))


def check_landed(rx: DecodeReceiver, ranks: list[FakeRank], rid: str, owners: list[int],
                  slots: list[int]) -> None:
    rp = rx.pages.requests[rid]
    assert rp.owners == [0] * len(rp.slots)
    for k in range(len(rp.slots)):  # decode page k == owner's page k, every layer, both buffers
        src, dst = ranks[owners[k]].pool.store, rx.store
        d_idx = torch.tensor([rp.slots[k]], device=dst.group.device)
        s_idx = torch.tensor([slots[k]], device=src.group.device)
        for layer in range(src.num_layers):  # each part's rows, whatever the two layouts
            for part in ("latent", "index_k"):
                assert torch.equal(read_part(dst.spec, layer, part, d_idx).cpu(),
                                   read_part(src.spec, layer, part, s_idx).cpu())


def next_request_works(rx: DecodeReceiver) -> None:
    ranks, owners, slots = fake_source(2, 5, seed=99, like=rx.store)
    assert transfer_pages(rx, ranks, owners, slots, "next", 37)
    check_landed(rx, ranks, "next", owners, slots)


def job_spec(tiny: Path, cp: int, mode: str, prefix: tuple[int, ...] = (), n: int = 4,
             pipeline: str = "request") -> JobSpec:
    rng = random.Random(cp)
    prompts = tuple(tuple(rng.randrange(512) for _ in range(k)) for k in (90, 45, 7, 130))
    s = load_settings(cp={"size": cp, "mode": mode}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]}, debug=True,
                      transfer={"name": "nccl", "timeout_s": 60, "pipeline": pipeline})
    return JobSpec(str(tiny), prompts, s, False, prefix, n)


def reference_tokens(spec: JobSpec) -> list[list[int]]:
    from cpkv.fallback import recording
    from cpkv.runtime.job import reference_rank

    with recording():
        return reference_rank(replace(spec, settings=spec.settings.with_cp_size(1)))[1]



# ---- transformers ------------------------------------------------------------------------------
#: a tiny DeepSeek-V3.2 config for transformers (the cpkv-side tiny model matches its shapes)
HF_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
    q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
    num_experts_per_tok=2, index_topk=16, index_head_dim=16, index_n_heads=4, first_k_dense_replace=1,
    max_position_embeddings=4096, initializer_range=0.1,
)


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits [T, vocab] of one request ``ids`` [T]."""
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


#: GLM-5 (``GlmMoeDsaForCausalLM``) over :data:`HF_TINY`: 4 layers, two of them shared-indexer
#: layers (full, shared, shared, full), GLM-5's eps
HF_GLM5 = dict(num_hidden_layers=4, indexer_types=["full", "shared", "shared", "full"],
               rms_norm_eps=1e-5)


def hf_random_model(tmp: Path, seed: int = 0, arch: str = "v32",
                    **overrides: object) -> torch.nn.Module:
    """A random transformers DeepSeek-V3.2 (``arch="v32"``) or GLM-5 (``"glm5"``:
    :data:`HF_GLM5`) of :data:`HF_TINY`'s shape (norms and biases made to matter), saved to
    ``tmp``; the caller skips without transformers (``importorskip``)."""
    import transformers

    if arch == "glm5":
        glm = transformers.GlmMoeDsaConfig(**{**HF_TINY, **HF_GLM5, **overrides})
        torch.manual_seed(seed)
        model = transformers.GlmMoeDsaForCausalLM(glm).eval()
    else:
        cfg = transformers.DeepseekV32Config(**{**HF_TINY, **overrides})
        torch.manual_seed(seed)
        model = transformers.DeepseekV32ForCausalLM(cfg).eval()
    with torch.no_grad():  # transformers initialises these to zero / one: make them matter
        for name, t in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.add_(0.1 * torch.randn_like(t))
            elif name.endswith("k_norm.bias"):
                t.normal_(0, 0.1)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.02)
    model.save_pretrained(tmp)
    return model


# ---- the engine example (issue 37) -------------------------------------------------------------
_ROOT = Path(__file__).resolve().parents[1]
ENGINE_EXAMPLE = _ROOT / "examples" / "engine" / "engine.py"


def run_engine_example(ranks: int, tmp: Path, *extra: str) -> dict[str, object]:
    """Run examples/engine/engine.py under torchrun with ``ranks`` ranks (this checkout's
    sources on PYTHONPATH); its JSON summary line (the run must succeed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(p) for p in [_ROOT / "core" / "src", *sorted((_ROOT / "backends").glob("*/src")),
                         *sorted((_ROOT / "plugins").glob("*/src")),
                         *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(ENGINE_EXAMPLE), *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, object] = json.loads(lines[-1])
    return out


# ---- processes (from /proc) --------------------------------------------------------------------
def _proc_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first, then the parent's pid),
    or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def children(pid: int) -> list[int]:
    """Live child processes of ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (f := _proc_fields(d.name)) is not None \
                and int(f[1]) == pid and f[0] != "Z":
            out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead, only unreaped)."""
    f = _proc_fields(pid)
    return f is not None and f[0] != "Z"


class ThreadRanks:
    """C ranks as threads of this process (``all_gather_rows`` through a barrier): CP runs
    fast enough for many hypothesis examples (the Gloo tests run the real group)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = [0] * size  # collectives per rank

    def run(self, fn: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                out[rank] = fn(ThreadRank(self, rank))
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        if errors:
            raise errors[0]
        return out


class ThreadRank:
    def __init__(self, shared: ThreadRanks, rank: int) -> None:
        self.shared, self.rank, self.size = shared, rank, shared.size
        self.device = torch.device("cpu")

    def all_gather_rows(self, local: torch.Tensor, max_rows: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        s = self.shared
        s.calls[self.rank] += 1
        buf = local.new_zeros((max_rows, *local.shape[1:]))
        buf[: local.shape[0]] = local
        s.slots[self.rank] = buf
        s.barrier.wait()
        got = torch.cat([cast(torch.Tensor, x) for x in s.slots])
        s.barrier.wait()  # every rank has read the slots before they are refilled
        return got
