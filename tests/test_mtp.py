"""The MTP draft layer (issue 14): checkpoint loading, the forward against an independent
reference (transformers' decoder layer wrapped by the DeepSeek-V3 report's MTP formula)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cpkv.models import DeepseekV32, ModelLoadError, write_tiny_checkpoint
from cpkv.models.loader import mtp_shapes
from cpkv.models.tiny import ARCHS
from cpkv.testing.checkpoints import copy_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}") / "ckpt", seed=3,
                                 **ARCHS[arch])


_copy = copy_checkpoint


# ---------------------------------------------------------------------------- checkpoint
def test_mtp_layer_loads_in_the_release_naming(tiny: Path) -> None:
    state = safetensors_torch.load_file(tiny / "model.safetensors")
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    L = cfg["num_hidden_layers"]  # the MTP layer's index (v32 tiny: 3, glm5 tiny: 4)
    names = mtp_shapes(DeepseekV32.load(tiny).config)
    for leaf in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                 "self_attn.indexer.wk", "self_attn.kv_a_proj_with_mqa", "mlp.gate"):
        assert f"model.layers.{L}.{leaf}.weight" in names
    assert all(tuple(state[k].shape) == v for k, v in names.items())
    plain, m = DeepseekV32.load(tiny), DeepseekV32.load(tiny, mtp=True)
    assert (plain.kv_layers, plain.mtp_layer) == (L, None)
    assert (m.num_layers, m.kv_layers, m.mtp_layer) == (L, L + 1, L)
    assert m.index_layers[L]  # the MTP layer runs its own indexer (both families)
    torch.testing.assert_close(m._layers[L].q_a, state[f"model.layers.{L}.self_attn.q_a_proj.weight"])
    assert m._mtp is not None and torch.equal(m._mtp.eh_proj, state[f"model.layers.{L}.eh_proj.weight"])
    # the target is the same with and without the MTP layer
    x = torch.randn(5, 64)
    assert torch.equal(plain.final_logits(x), m.final_logits(x))
    with pytest.raises(ValueError, match="without its MTP draft layer"):
        plain.draft_embed(torch.tensor([1]))
    with pytest.raises(IndexError):
        plain.attention_inputs(L, x, torch.arange(5))


def test_mtp_shares_embedding_and_head_when_absent(tmp_path: Path, tiny: Path) -> None:
    L = json.loads((tiny / "config.json").read_text())["num_hidden_layers"]

    def drop(s: dict) -> None:  # type: ignore[type-arg]
        del s[f"model.layers.{L}.embed_tokens.weight"], s[f"model.layers.{L}.shared_head.head.weight"]

    m = DeepseekV32.load(_copy(tiny, tmp_path / "c", mutate_state=drop), mtp=True)
    assert m._mtp is not None and m._mtp.embed is m._embed and m._mtp.head is m._lm_head


def test_asking_mtp_of_a_checkpoint_without_it_is_a_clear_error(tmp_path: Path, tiny: Path,
                                                                arch: str) -> None:
    L = json.loads((tiny / "config.json").read_text())["num_hidden_layers"]
    none = write_tiny_checkpoint(tmp_path / "none", seed=3, num_nextn_predict_layers=0,
                                 **ARCHS[arch])
    assert DeepseekV32.load(none).num_layers == L  # loads as before
    with pytest.raises(ModelLoadError, match=r"MTP draft layer was asked for.*num_nextn_predict_layers = 0"):
        DeepseekV32.load(none, mtp=True)

    def strip(s: dict) -> None:  # type: ignore[type-arg]
        for k in [k for k in s if k.startswith(f"model.layers.{L}.")]:
            del s[k]

    stripped = _copy(tiny, tmp_path / "s", mutate_state=strip)
    assert DeepseekV32.load(stripped).num_layers == L
    with pytest.raises(ModelLoadError, match=rf"no model\.layers\.{L}\.\* weight is stored"):
        DeepseekV32.load(stripped, mtp=True)

    def half(s: dict) -> None:  # type: ignore[type-arg]
        del s[f"model.layers.{L}.eh_proj.weight"]

    with pytest.raises(ModelLoadError, match=rf"missing weight\(s\): model\.layers\.{L}\.eh_proj"):
        DeepseekV32.load(_copy(tiny, tmp_path / "h", mutate_state=half), mtp=True)


def test_init_model_writes_an_mtp_layer(tmp_path: Path) -> None:
    from cpkv.cli.init_model import command

    r = CliRunner().invoke(command, [str(tmp_path / "a"), "--layers", "2"])
    assert r.exit_code == 0, r.output
    assert DeepseekV32.load(tmp_path / "a", mtp=True).mtp_layer == 2
    r = CliRunner().invoke(command, [str(tmp_path / "b"), "--layers", "2", "--no-mtp"])
    assert r.exit_code == 0, r.output
    with pytest.raises(ModelLoadError, match="has none"):
        DeepseekV32.load(tmp_path / "b", mtp=True)
    r = CliRunner().invoke(command, [str(tmp_path / "c"), "--draft", "agree", "--no-mtp"])
    assert r.exit_code != 0 and "needs an MTP layer" in r.output


# ---------------------------------------------------------------------------- the MTP forward
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mtp_reference(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """Draft logits of every row, from the DeepSeek-V3 report's MTP definition, independent of
    cpkv: the target is transformers' DeepSeek-V3.2 (``h_i``: its last hidden state, after the
    final norm), ``h'_i = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))`` written out here, the
    MTP decoder layer is transformers' decoder layer (a one-layer model fed ``inputs_embeds``),
    and ``shared_head`` is its final norm and head. ``t_{i+1}`` of the last row is the target's
    greedy token."""
    transformers = pytest.importorskip("transformers")
    state = safetensors_torch.load_file(ckpt / "model.safetensors")
    glm = json.loads((ckpt / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    lm_cls = transformers.GlmMoeDsaForCausalLM if glm else transformers.DeepseekV32ForCausalLM
    cfg_cls = transformers.GlmMoeDsaConfig if glm else transformers.DeepseekV32Config
    target = lm_cls.from_pretrained(ckpt, attn_implementation="eager").eval()
    cfg = target.config
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = f"model.layers.{n_layers}"
    with torch.no_grad():
        h = target.model(input_ids=ids[None]).last_hidden_state[0]
        nxt = torch.cat([ids[1:], target.lm_head(h[-1:]).argmax(-1)])
        e = state[f"{p}.embed_tokens.weight"][nxt]
        x = torch.cat([_rms(e, state[f"{p}.enorm.weight"], eps),
                       _rms(h, state[f"{p}.hnorm.weight"], eps)], -1) @ state[f"{p}.eh_proj.weight"].T
        kind = "dense" if n_layers < cfg.first_k_dense_replace else "sparse"
        one_cfg = cfg_cls(**{**cfg.to_dict(), "num_hidden_layers": 1,
                             "first_k_dense_replace": int(kind == "dense"),
                             "mlp_layer_types": [kind], "layer_types": ["indexed_attention"],
                             **({"indexer_types": ["full"]} if glm else {})})
        one = lm_cls(one_cfg).eval()
        sd = {k.replace(f"{p}.", "model.layers.0."): v for k, v in state.items()
              if k.startswith(p + ".")}
        sd["model.norm.weight"] = state[f"{p}.shared_head.norm.weight"]
        sd["lm_head.weight"] = state[f"{p}.shared_head.head.weight"]
        sd["model.embed_tokens.weight"] = state["model.embed_tokens.weight"]
        missing, _ = one.load_state_dict(
            {k: v for k, v in sd.items() if k.split(".")[-2] not in ("enorm", "hnorm", "eh_proj")
             and "shared_head" not in k and "layers.0.embed_tokens" not in k}, strict=False)
        assert not [k for k in missing if "experts" not in k], missing
        if any("experts" in k for k in missing):  # transformers keeps the experts packed
            e_ = one_cfg.n_routed_experts
            pre = "model.layers.0.mlp.experts"
            one.model.layers[0].mlp.experts.gate_up_proj.copy_(torch.stack([
                torch.cat([sd[f"{pre}.{j}.gate_proj.weight"], sd[f"{pre}.{j}.up_proj.weight"]])
                for j in range(e_)]))
            one.model.layers[0].mlp.experts.down_proj.copy_(torch.stack([
                sd[f"{pre}.{j}.down_proj.weight"] for j in range(e_)]))
        return one(inputs_embeds=x[None]).logits[0].float()


def test_mtp_forward_equals_the_published_definition(tiny: Path) -> None:
    """One rank: the draft logits of every row (the MTP layer as pool layer ``num_layers``, run
    by the prefill driver) equal the independent reference within the CP tolerance."""
    from cpkv.comm import CPGroup
    from cpkv.fallback import recording
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4))
    s = load_settings(cp={"size": 1}, kv={"page_size": 8, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    with recording() as rec:
        session = PrefillSession(DeepseekV32.load(tiny, mtp=True), s, CPGroup.single())
        res = session.prefill([("a", ids.tolist())], all_logits=True)
    assert not rec.events
    assert session.pool.num_layers == session.model.num_layers + 1
    assert res.draft_embedding == "local"
    ref = mtp_reference(tiny, ids)
    got = res.all_draft_logits
    assert got is not None and got.shape == ref.shape == (40, 512)
    rel = ((got - ref).abs().amax() / ref.abs().amax()).item()
    assert rel < 1e-4, rel
    assert res.draft_logits is not None and torch.equal(res.draft_logits[0], got[-1])
    assert ref.std() > 0.1  # the draft is not degenerate


# ---------------------------------------------------------------------------- CP draft prefill
PAGE = 8


def _draft_cases(cp: int) -> list[tuple[str, object, tuple[tuple[int, ...], ...], tuple[int, ...]]]:
    """Both modes, fp32 pools; batches without and with cached prefixes (20 and 3 end mid-page)."""
    import random

    from cpkv.settings import load_settings

    rng = random.Random(cp)
    prompts = tuple(tuple(rng.randrange(512) for _ in range(n)) for n in (90, 45, 7, 130))
    out = []
    for mode in ("zigzag", "interleave"):
        s = load_settings(cp={"size": cp, "mode": mode}, kv={"page_size": PAGE, "dtype": "fp32"},
                          backend={"preference": ["torch"]}, runtime={"logits_budget_mb": 1})
        for prefix in [(), (20, 0, 3, 64)]:
            out.append((f"{mode} prefix={prefix}", s, prompts, prefix))
    return out


def _draft_prefill(group, model_dir: str, cases) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every case on this rank: the prefixes first (a non-final chunk: its next token is known),
    then the rest; the second batch's draft and target logits of every row."""
    from cpkv.runtime.session import PrefillSession

    model = DeepseekV32.load(model_dir, mtp=True)
    out = []
    for _, s, prompts, prefix in cases:
        session = PrefillSession(model, s.with_cp_size(group.size), group)
        rids = [f"p{i}" for i in range(len(prompts))]
        if any(prefix):
            first = [(rid, p[:n]) for rid, p, n in zip(rids, prompts, prefix, strict=True) if n]
            nxt = [p[n] for p, n in zip(prompts, prefix, strict=True) if n]
            session.prefill(first, next_ids=nxt)
        done = dict(zip(rids, prefix or (0,) * len(rids), strict=True))
        res = session.prefill([(rid, p[done[rid]:]) for rid, p in zip(rids, prompts, strict=True)],
                              all_logits=True)
        out.append({"draft": res.all_draft_logits, "logits": res.all_logits,
                    "how": res.draft_embedding, "pages": session.pool.footprint().pages_held})
    return out


def _check_draft(cp_out: dict, ref: dict, name: str) -> None:  # type: ignore[type-arg]
    for key in ("logits", "draft"):
        a, b = cp_out[key], ref[key]
        rel = ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()
        assert rel <= 1e-4, f"{name}: {key} logits differ by {rel:.2e} relative"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_draft_logits_equal_single_rank(cp: int, tiny: Path) -> None:
    """Rule 23 for the draft layer: every row's draft logits under CP (both modes, prefixes
    ending mid-page, a short extend taking the token-balanced split) equal one rank's; each rank
    embeds its local rows (no fallback)."""
    from cpkv.comm import CPGroup
    from cpkv.fallback import recording
    from cpkv.runtime import run_ranks

    cases = _draft_cases(cp)
    results = run_ranks(_draft_prefill, cp, args=(str(tiny), cases), timeout_s=400)
    with recording():
        ref = _draft_prefill(CPGroup.single(), str(tiny), cases)
    for i, (name, *_rest) in enumerate(cases):
        _check_draft(results[0].value[i], ref[i], f"CP{cp} {name}")
        assert [r.value[i]["how"] for r in results] == ["local"] * cp
        assert sum(r.value[i]["pages"] for r in results) == ref[i]["pages"]
    for r in results:  # no draft fallback (the short extend's split fallback is the target's)
        assert not [e for e in r.fallbacks if e.reason == "draft_plan_missing"]


def _embedding_shapes(group, model_dir: str, prompts) -> dict:  # type: ignore[no-untyped-def]
    """The same batch three times on fresh requests: with the plan (local embedding), with the
    plan withheld, with a stale plan (another batch's); then withheld under policy "error"."""
    from cpkv.fallback import FallbackError, recording
    from cpkv.planning import plan_batch
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    s = load_settings(cp={"size": group.size}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    model = DeepseekV32.load(model_dir, mtp=True)
    seen: list[tuple[int, ...]] = []
    real = model.draft_embed

    def spy(ids: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(ids.shape))
        return real(ids)

    model.draft_embed = spy  # type: ignore[method-assign]
    session = PrefillSession(model, s, group)
    stale = plan_batch([session.pool.pages.request_spec("x", 50)], group.size, PAGE, s.cp.mode)
    out: dict = {"shapes": {}, "draft": {}, "events": {}}
    for how, plan in (("local", "batch"), ("withheld", None), ("stale", stale)):
        kw = {} if plan == "batch" else {"draft_plan": plan}
        seen.clear()
        with recording() as rec:
            res = session.prefill([(f"{how}{i}", p) for i, p in enumerate(prompts)],
                                  all_logits=True, **kw)
        out["shapes"][how] = list(seen)
        out["draft"][how] = res.all_draft_logits
        out["events"][how] = [(e.op, e.reason.value, e.detail) for e in rec.events
                              if e.op == "draft_embedding"]
        out["max_rank_len"], out["tokens"] = res.plan.max_rank_len, res.plan.num_tokens
        out["how_" + how] = res.draft_embedding
    with recording("error"):
        try:
            session.prefill([("err", prompts[0])], draft_plan=None)
            out["refused"] = False
        except FallbackError as exc:
            out["refused"] = exc.event.reason.value == "draft_plan_missing"
    out["err_left"] = "err" in session.pool.pages.requests
    return out


@pytest.mark.multiprocess
@pytest.mark.slow_on_arch("glm5")  # 6.6 CPU seconds; v32 keeps it in the fast subset
def test_each_rank_embeds_max_rank_len_rows_and_the_fallback_is_visible(tiny: Path) -> None:
    """Rule 32: with the plan each rank's draft embedding input is ``[max_rank_len]`` ids (not
    the batch's tokens); withheld or stale plan metadata embeds the whole batch, reported as
    ``draft_plan_missing`` on every rank (same draft logits); policy "error" refuses it."""
    import random

    from cpkv.runtime import run_ranks

    rng = random.Random(7)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (70, 33)]
    out = [r.value for r in run_ranks(_embedding_shapes, 2, args=(str(tiny), prompts),
                                      timeout_s=300)]
    for r in out:
        n, width = r["tokens"], r["max_rank_len"]
        assert n == 103 and width < n
        assert r["shapes"]["local"] == [(width,)] and r["how_local"] == "local"
        assert not r["events"]["local"]
        for how in ("withheld", "stale"):
            assert r["shapes"][how] == [(n,)] and r["how_" + how] == "full"
            [(_, reason, detail)] = r["events"][how]
            assert reason == "draft_plan_missing"
            assert ("no plan" in detail) if how == "withheld" else ("(prefix, extend)" in detail)
            a, b = r["draft"][how], r["draft"]["local"]
            assert ((a - b).abs().amax() / b.abs().amax()).item() < 1e-5
        assert r["refused"] and not r["err_left"]


# ---------------------------------------------------------------------------- speculative decoding
@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("agree") / "ckpt", seed=3, draft="agree")


def _decode_session(model: DeepseekV32):  # type: ignore[no-untyped-def]
    from cpkv.comm import CPGroup
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]}, cache={"enabled": False})
    return PrefillSession(model, s, CPGroup.single())


def _valid_rows(session, rid: str) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every pool layer's stored bytes of the request's valid rows, as float32."""
    pool = session.pool
    rp = pool.pages.requests[rid]
    out = []
    for layer in range(pool.num_layers):
        rows = torch.cat([pool.store.kv[layer][s] for s in rp.slots])[: rp.valid_len]
        out.append(rows.contiguous().view(torch.float32))
    return out


def _spec_vs_plain(ckpt: Path, prompts: list[list[int]], n: int, k: int):  # type: ignore[no-untyped-def]
    from cpkv.fallback import recording
    from cpkv.runtime.decode import generate, greedy
    from cpkv.runtime.speculative import speculative_generate

    model = DeepseekV32.load(ckpt, mtp=True)
    rids = [f"r{i}" for i in range(len(prompts))]
    with recording():
        plain, spec = _decode_session(model), _decode_session(model)
        res = plain.prefill(list(zip(rids, prompts, strict=True)))
        first = greedy(res.last_logits)
        want = generate(plain, list(zip(rids, first, strict=True)), n)
        res = spec.prefill(list(zip(rids, prompts, strict=True)))
        assert greedy(res.last_logits) == first and res.draft_logits is not None
        drafts = greedy(res.draft_logits)
        got, stats = speculative_generate(spec, list(zip(rids, first, drafts, strict=True)), n, k)
    return plain, spec, rids, want, got, stats


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy(tiny: Path, k: int) -> None:
    """A random draft (mostly rejected): the output is plain greedy's token for token; the pool
    keeps every accepted row (equal to plain decoding's KV in every layer, the MTP layer's too)
    and no rejected one (valid length and pages)."""
    import random

    rng = random.Random(11)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (21, 8, 37)]  # end mid-page
    plain, spec, rids, want, got, stats = _spec_vs_plain(tiny, prompts, 12, k)
    assert got == want
    assert stats.proposed > 0 and stats.steps <= stats.plain_steps == 11
    for rid, p in zip(rids, prompts, strict=True):
        n_emitted = len(p) + sum(1 + a for a in stats.accepted_per_request[rid])
        rp = spec.pool.pages.requests[rid]
        assert rp.valid_len == n_emitted  # the last emitted token is not in the KV yet
        assert len(rp.slots) == -(-rp.valid_len // PAGE)  # rejected rows' pages went back
        mine, ref = _valid_rows(spec, rid), _valid_rows(plain, rid)
        for layer, (a, b) in enumerate(zip(mine, ref, strict=False)):  # plain holds fewer rows
            rows = min(a.shape[0], b.shape[0])
            torch.testing.assert_close(a[:rows], b[:rows], rtol=1e-4, atol=1e-4,
                                       msg=f"{rid} layer {layer}")
    assert spec.pool.footprint().pages_held == sum(len(spec.pool.pages.requests[r].slots) for r in rids)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_an_agreeing_draft_is_accepted_and_saves_steps(agree: Path, k: int) -> None:
    """A checkpoint whose MTP layer is built to guess the target's next token: accept rate above
    0.8, and the decode steps fall accordingly; the output is still plain greedy's."""
    import random

    rng = random.Random(12)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (30, 17)]
    n = 25
    _, _, _, want, got, stats = _spec_vs_plain(agree, prompts, n, k)
    assert got == want
    print(stats.as_dict())
    assert stats.accept_rate > 0.8, stats.as_dict()
    assert stats.accepted < stats.proposed  # some drafts are rejected: both paths run
    # each step emits 1 + accepted drafts: the steps are what that predicts
    assert stats.steps <= -(-(n - 1) // (1 + 0.8 * k)) + 1
    assert stats.mean_accepted_length > 1 + 0.8 * k - 0.01


# ---------------------------------------------------------------------------- the job
@pytest.mark.multiprocess
@pytest.mark.slow
def test_mtp_pages_move_with_the_rest_and_decode_speculates(agree: Path) -> None:
    """CP2 prefill with the draft layer, the nccl transfer (Gloo) and speculative decoding:
    every owner sends its own pages of every layer, the MTP layer's included (bytes and
    per-page CRCs over all layers); the decode pool has the MTP layer; chunked prefixes take
    the prompt's next token; the tokens are plain greedy's, most drafts accepted."""
    import random
    from dataclasses import replace

    from cpkv.fallback import recording
    from cpkv.runtime import run_ranks
    from cpkv.runtime.job import JobSpec, disagg_rank, reference_rank
    from cpkv.settings import load_settings

    rng = random.Random(2)
    prompts = tuple(tuple(rng.randrange(512) for _ in range(k)) for k in (90, 45, 7, 130))
    s = load_settings(cp={"size": 2, "mode": "zigzag"}, kv={"page_size": PAGE, "dtype": "fp32"},
                      backend={"preference": ["torch"]}, debug=True,
                      transfer={"name": "nccl", "timeout_s": 60})
    spec = JobSpec(str(agree), prompts, s, False, (20, 0, 3, 64), 10, mtp=True, draft_tokens=2)
    out = run_ranks(disagg_rank, 3, args=(spec,), timeout_s=300)
    senders, dec = [r.value for r in out[:2]], out[2].value
    model = DeepseekV32.load(agree, mtp=True)
    assert dec.kv_layers == model.kv_layers == 4
    page_bytes = model.kv_format("fp32", PAGE).page_bytes * model.kv_layers
    for r, snd in enumerate(senders):
        owned = sum(len(v) for v in snd.page_crcs.values())
        assert snd.bytes_sent == owned * page_bytes == dec.bytes_per_rank[r]
        assert snd.prefill.draft_logits is not None
    for rid, crcs in dec.page_crcs.items():
        owner_crc: dict[int, int] = {}
        for snd in senders:
            owner_crc.update(snd.page_crcs[rid])
        assert crcs == [owner_crc[k] for k in range(len(crcs))], rid
    with recording():
        ref, ref_tokens = reference_rank(replace(spec, settings=s.with_cp_size(1)))
    assert dec.tokens == ref_tokens
    a, b = senders[0].prefill.draft_logits, ref.draft_logits
    assert ((a - b).abs().amax() / b.abs().amax()).item() < 1e-4
    sp = dec.speculation
    # (test_an_agreeing_draft_is_accepted_and_saves_steps holds the 0.8 bar on longer outputs)
    assert sp is not None and sp.accept_rate > 0.6 and sp.steps_saved > 0 and sp.draft_tokens == 2, sp


def test_run_mtp_needs_a_checkpoint_with_an_mtp_layer(tmp_path: Path) -> None:
    from cpkv.cli.run import command

    none = write_tiny_checkpoint(tmp_path / "none", num_nextn_predict_layers=0)
    r = CliRunner().invoke(command, ["--model", str(none), "--mtp"])
    assert r.exit_code == 1 and "has none (config.json: num_nextn_predict_layers = 0)" in r.output


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpkv_run_mtp_reports_the_draft(agree: Path, tmp_path: Path) -> None:
    """``cpkv run --mtp`` (the default prompts: cache hits ending mid-page, a short extend):
    the report's ``draft`` has the accept rate, mean accepted length, steps saved and the
    tokens checked against plain greedy decoding on one rank."""
    import os
    import subprocess
    import sys

    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "cpkv", "run", "--model", str(agree), "--mtp",
                          "--draft-tokens", "2", "--decode-tokens", "16", "--report", str(report)],
                         capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "CPKV_KV__DTYPE": "fp32"})
    assert out.returncode == 0, out.stdout + out.stderr
    rep = json.loads(report.read_text())
    d = rep["draft"]
    assert rep["correct"] is True and d["tokens_match_reference"] is True
    assert d["draft_tokens"] == 2 and d["decode_kv_layers"] == 4
    assert d["accept_rate"] > 0.6 and d["steps_saved"] > 0 and d["mean_accepted_length"] > 1.5
    assert d["plain_steps"] == 15 and d["steps"] == d["plain_steps"] - d["steps_saved"]
    assert d["prefill_max_rel_err_vs_reference"] <= 1e-4
    assert rep["cache"]["hit_tokens"] == [0, 99, 0, 599]  # hits stop one token short
    assert not [f for f in rep["fallbacks"] if f["reason"] == "draft_plan_missing"]
    assert "speculative decoding (k = 2)" in out.stdout


@pytest.mark.slow  # 4 s: a whole bench
@pytest.mark.multiprocess
def test_bench_mtp_runs_small_on_cpus(tmp_path: Path) -> None:
    """``cpkv bench mtp`` at small sizes on CPUs: the local embedding is half the full one on
    CP2, and speculative decoding's tokens are plain greedy's (the command fails otherwise)."""
    from cpkv.cli.bench import command

    out = tmp_path / "mtp.json"
    r = CliRunner().invoke(command, ["mtp", "--out", str(out), "--tokens", "256", "--prompts",
                                     "40", "--decode-tokens", "6", "--backends", "torch"])
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    rows = {row["name"]: row for row in rep["results"]}
    assert rows["draft_embedding_256_cp2_local_mb"]["ratio"] == pytest.approx(0.5, abs=0.05)
    assert "decode_tok_s_speculative_k1" in rows
    assert rep["detail"]["decode"]["tokens_match"] is True
    assert all(m["full"]["fallbacks"] == ["draft_plan_missing"] and not m["local"]["fallbacks"]
               for m in rep["detail"]["memory"])


def test_a_cache_hit_recomputes_the_draft_row_of_its_last_token(tiny: Path) -> None:
    """The draft row at a hit's last position was computed with the cached request's next
    token: with the draft layer the hit stops one token short and that row is recomputed, so a
    request that diverges right after a cached prefix gets the no-cache draft logits. Taking
    the whole hit instead (the row stale) gives different ones: the shortening is needed."""
    import random

    from cpkv.comm import CPGroup
    from cpkv.fallback import recording
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    rng = random.Random(5)
    shared = [rng.randrange(512) for _ in range(29)]  # ends inside an 8-token page
    a = [*shared, *[rng.randrange(512) for _ in range(10)]]
    b = [*shared, (a[29] + 1) % 512, *[rng.randrange(512) for _ in range(9)]]
    model = DeepseekV32.load(tiny, mtp=True)

    def session(cache: bool) -> PrefillSession:
        s = load_settings(cp={"size": 1}, kv={"page_size": PAGE, "dtype": "fp32"},
                          backend={"preference": ["torch"]}, cache={"enabled": cache})
        return PrefillSession(model, s, CPGroup.single())

    with recording():
        ref = session(False).prefill([("b", b)], all_logits=True).all_draft_logits
        cached = session(True)
        cached.prefill([("a", a)])
        cached.finish("a", a)
        hit = cached.admit("b", b)
        got = cached.prefill([("b", b[hit:])], all_logits=True).all_draft_logits
        # the same, taking the whole hit (what the cache holds) without the shortening
        stale = session(True)
        stale.prefill([("a", a)])
        stale.finish("a", a)
        assert stale.cache is not None
        whole = stale.cache.attach("b", stale.cache.match(b))
        bad = stale.prefill([("b", b[whole:])], all_logits=True).all_draft_logits
    assert (hit, whole) == (28, 29)
    assert ref is not None and got is not None and bad is not None

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).abs().amax() / y.abs().amax()).item()

    assert rel(got, ref[hit:]) < 1e-4
    assert rel(bad, ref[whole:]) > 1e-3


@pytest.fixture(scope="module")
def models(tiny: Path, agree: Path) -> dict[str, DeepseekV32]:
    return {"random": DeepseekV32.load(tiny, mtp=True), "agree": DeepseekV32.load(agree, mtp=True)}


@pytest.mark.slow
def test_speculative_equals_plain_greedy_property(models: dict[str, DeepseekV32]) -> None:
    """Property: for any batch of prompts (lengths 1..40, ending anywhere in a page), any k and
    any number of tokens, with a draft that is mostly wrong or mostly right, speculative greedy
    tokens are plain greedy's."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cpkv.fallback import recording
    from cpkv.runtime.decode import generate, greedy
    from cpkv.runtime.speculative import speculative_generate

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=3), k=st.integers(1, 4),
           n=st.integers(2, 12), which=st.sampled_from(["random", "agree"]),
           seed=st.integers(0, 2**16))
    def check(lens: list[int], k: int, n: int, which: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, 512, (m,), generator=gen).tolist() for m in lens]
        rids = [f"r{i}" for i in range(len(lens))]
        model = models[which]
        with recording():
            plain, spec = _decode_session(model), _decode_session(model)
            first = greedy(plain.prefill(list(zip(rids, prompts, strict=True))).last_logits)
            want = generate(plain, list(zip(rids, first, strict=True)), n)
            res = spec.prefill(list(zip(rids, prompts, strict=True)))
            assert res.draft_logits is not None
            got, stats = speculative_generate(
                spec, list(zip(rids, first, greedy(res.draft_logits), strict=True)), n, k)
        assert got == want
        assert stats.steps <= stats.plain_steps == n - 1
        for rid, p in zip(rids, prompts, strict=True):
            rp = spec.pool.pages.requests[rid]
            assert rp.valid_len == len(p) + sum(1 + a for a in stats.accepted_per_request[rid])
            assert len(rp.slots) == -(-rp.valid_len // PAGE)

    check()
