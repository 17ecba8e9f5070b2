"""cpkv.settings: defaults, sources and their priority, and errors that name their location."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from pydantic import BaseModel

from cpkv.contracts import FallbackPolicy, KVDtype, SplitMode
from cpkv.settings import BackendSettings, Settings, SettingsError, load_settings, unknown_env_vars

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpkv.toml"


def _write(tmp_path: Path, text: str, name: str = "cpkv.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _leaf_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every leaf key of ``model`` as a path of names, sections walked recursively."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_paths(ann, (*prefix, name))
        else:
            out.append((*prefix, name))
    return out


def _example_keys() -> dict[tuple[str, ...], int]:
    """Keys set (or shown commented out) in the example file, mapped to their line index."""
    keys: dict[tuple[str, ...], int] = {}
    section: tuple[str, ...] = ()
    for i, line in enumerate(EXAMPLE.read_text().splitlines()):
        if m := re.match(r"^\[([a-z_.]+)\]\s*$", line):
            section = tuple(m.group(1).split("."))
        elif m := re.match(r"^#?\s*([a-z_][a-z0-9_]*)\s*=", line):
            keys[(*section, m.group(1))] = i
    return keys


# --- defaults and the example file ---------------------------------------------------------------


def test_defaults_without_a_file() -> None:
    s = load_settings()
    assert s.debug is False
    assert (s.cp.size, s.cp.mode) == (2, SplitMode.ZIGZAG)
    assert (s.kv.shared, s.kv.dtype, s.kv.page_size, s.kv.pages_per_rank) == (
        True,
        "auto",
        64,
        4096,
    )
    assert s.runtime.indexer_dtype == "auto"
    assert s.backend.name == "auto"
    assert s.backend.preference == ["cuda", "triton", "torch"]
    assert (s.transfer.name, s.transfer.timeout_s) == ("nccl", 30.0)
    assert (s.plugins.disable, s.plugins.allow) == ([], None)
    assert s.fallback.policy is FallbackPolicy.WARN
    assert (s.runtime.timeout_s, s.runtime.logits_budget_mb, s.runtime.chunk_tokens) == (
        120.0, "auto", 0)
    assert s == Settings()


def test_example_file_equals_defaults() -> None:
    assert load_settings(EXAMPLE) == Settings()


def test_example_file_documents_every_key() -> None:
    """Meta-test: every leaf key of every section appears in the example, under a comment."""
    keys = _example_keys()
    lines = EXAMPLE.read_text().splitlines()
    missing = [".".join(p) for p in _leaf_paths(Settings) if p not in keys]
    assert not missing, f"keys missing from {EXAMPLE.name}: {missing}"
    undocumented = []
    for path, i in keys.items():
        above = lines[i - 1].strip() if i else ""
        if not above.startswith("#"):
            undocumented.append(".".join(path))
    assert not undocumented, f"keys without a comment above them: {undocumented}"
    stale = [".".join(p) for p in keys if p not in set(_leaf_paths(Settings))]
    assert not stale, f"{EXAMPLE.name} shows keys that are not settings: {stale}"


def test_example_file_sets_every_non_null_default_explicitly() -> None:
    text = EXAMPLE.read_text()
    for path in _leaf_paths(Settings):
        section: object = Settings()
        for name in path:
            section = getattr(section, name)
        if section is None:
            continue  # TOML has no null: shown commented out
        assert re.search(rf"^{path[-1]}\s*=", text, re.MULTILINE), f"{'.'.join(path)} is not set"


# --- sources and priority -----------------------------------------------------------------------


def test_toml_values_are_read_and_enums_accept_strings(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
debug = true
[cp]
size = 8
mode = "interleave"
[kv]
dtype = "fp8"
[fallback]
policy = "error"
[plugins]
allow = ["torch"]
""",
    )
    s = load_settings(path)
    assert s.debug is True
    assert s.cp.size == 8 and s.cp.mode is SplitMode.INTERLEAVE
    assert s.kv.dtype is KVDtype.FP8
    assert s.fallback.policy is FallbackPolicy.ERROR
    assert s.plugins.allow == ["torch"]
    assert s.kv.page_size == 64  # untouched keys keep their default


def test_priority_init_over_env_over_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "[cp]\nsize = 3\n")
    assert load_settings(path).cp.size == 3
    monkeypatch.setenv("CPKV_CP__SIZE", "4")
    assert load_settings(path).cp.size == 4
    assert load_settings(path, cp={"size": 5}).cp.size == 5


def test_sources_merge_key_by_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, "[kv]\npage_size = 128\nshared = true\n")
    monkeypatch.setenv("CPKV_KV__SHARED", "false")
    s = load_settings(path, kv={"dtype": "fp8"})
    assert (s.kv.shared, s.kv.page_size, s.kv.dtype) == (False, 128, KVDtype.FP8)


def test_nested_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPKV_KV__SHARED", "false")
    assert load_settings().kv.shared is False
    assert Settings().kv.shared is False


def test_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPKV_DEBUG", "1")
    assert load_settings().debug is True


def test_env_names_are_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("cpkv_runtime__timeout_s", "7.5")
    assert load_settings().runtime.timeout_s == 7.5


def test_env_json_for_lists_and_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPKV_BACKEND__PREFERENCE", '["torch"]')
    monkeypatch.setenv("CPKV_PLUGINS", '{"disable": ["cuda"]}')
    s = load_settings()
    assert s.backend.preference == ["torch"]
    assert s.plugins.disable == ["cuda"]


def test_file_path_does_not_leak_into_later_loads(tmp_path: Path) -> None:
    path = _write(tmp_path, "[cp]\nsize = 7\n")
    assert load_settings(path).cp.size == 7
    assert load_settings().cp.size == 2
    assert Settings().cp.size == 2


def test_concurrent_loads_see_their_own_file(tmp_path: Path) -> None:
    paths = {n: _write(tmp_path, f"[cp]\nsize = {n}\n", f"{n}.toml") for n in range(1, 9)}
    wrong: list[tuple[int, int]] = []

    def work(n: int) -> None:
        for _ in range(20):
            got = load_settings(paths[n]).cp.size
            if got != n:
                wrong.append((n, got))

    threads = [threading.Thread(target=work, args=(n,)) for n in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not wrong


# --- errors ---------------------------------------------------------------------------------------


def test_misspelt_toml_key_names_its_location_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[kv]\nsharedd = true\n")
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    msg = str(info.value)
    assert "kv.sharedd: unknown key; did you mean kv.shared?" in msg
    assert str(path) in msg
    (problem,) = info.value.problems
    assert (problem.key, problem.origin) == ("kv.sharedd", str(path))


@pytest.mark.parametrize(("toml", "wrong", "right"), [
    ("[runtime]\ntimout_s = 5\n", "runtime.timout_s", "runtime.timeout_s"),
    ("[run]\ntimeout_s = 5\n", "run.timeout_s", "runtime.timeout_s"),  # the wrong section
    ("[runtme]\ntimeout_s = 5\n", "runtme", "runtime"),
])
def test_a_misspelt_key_suggests_the_real_one(tmp_path: Path, toml: str, wrong: str,
                                              right: str) -> None:
    with pytest.raises(SettingsError, match=rf"{re.escape(wrong)}: unknown key; did you mean "
                                            rf"{re.escape(right)}\?"):
        load_settings(_write(tmp_path, toml))


def test_a_key_like_no_other_gets_no_suggestion(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(_write(tmp_path, "[kv]\nzzzz = 1\n"))
    assert "kv.zzzz: unknown key [from" in str(info.value)


def test_unknown_top_level_and_section_keys(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"\bfoo: unknown key"):
        load_settings(_write(tmp_path, "foo = 1\n"))
    with pytest.raises(SettingsError, match=r"\bspeed: unknown key"):
        load_settings(_write(tmp_path, "[speed]\nx = 1\n", "b.toml"))


@pytest.mark.parametrize(
    ("toml", "location", "value"),
    [
        ("[cp]\nsize = 0\n", "cp.size", "0"),
        ('[cp]\nmode = "spiral"\n', "cp.mode", "'spiral'"),
        ('[kv]\ndtype = "fp4"\n', "kv.dtype", "'fp4'"),
        ("[kv]\npage_size = -1\n", "kv.page_size", "-1"),
        ("[kv]\npages_per_rank = 0\n", "kv.pages_per_rank", "0"),
        ("[backend]\npreference = []\n", "backend.preference", "[]"),
        ("[transfer]\ntimeout_s = 0.0\n", "transfer.timeout_s", "0.0"),
        ('[fallback]\npolicy = "ignore"\n', "fallback.policy", "'ignore'"),
        ("[runtime]\ntimeout_s = -5\n", "runtime.timeout_s", "-5"),
        ("[runtime]\nlogits_budget_mb = 0\n", "runtime.logits_budget_mb", "0"),
        ('[kv]\nshared = "maybe"\n', "kv.shared", "'maybe'"),
    ],
)
def test_bad_value_names_location_value_and_file(
    tmp_path: Path, toml: str, location: str, value: str
) -> None:
    path = _write(tmp_path, toml)
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    msg = str(info.value)
    assert re.search(rf"(^|\s){re.escape(location)}: ", msg, re.MULTILINE), msg
    assert f"(got {value})" in msg
    assert str(path) in msg


def test_every_bad_value_is_reported_at_once(tmp_path: Path) -> None:
    path = _write(tmp_path, '[cp]\nsize = 0\nmode = "spiral"\n')
    with pytest.raises(SettingsError) as info:
        load_settings(path)
    msg = str(info.value)
    assert "cp.size" in msg and "cp.mode" in msg


def test_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPKV_CP__SIZE", "0")
    with pytest.raises(SettingsError, match=r"cp\.size: .*environment variable CPKV_CP__SIZE"):
        load_settings()


def test_bad_override_value_names_location() -> None:
    with pytest.raises(SettingsError, match=r"kv\.page_size: .*\(got 0\).*keyword arguments"):
        load_settings(kv={"page_size": 0})


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(SettingsError, match="not found") as info:
        load_settings(path)
    assert str(path) in str(info.value)


def test_directory_is_not_a_settings_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=re.escape(str(tmp_path))):
        load_settings(tmp_path)


def test_toml_syntax_error_names_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[cp\nsize = = 2\n")
    with pytest.raises(SettingsError, match="not valid TOML") as info:
        load_settings(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "name", ["CPKV_KV__SHARD", "CPKV_FOO", "CPKV_KV__SHARED__X", "CPKV_DEBUG__ON", "cpkv_cp__sise"]
)
def test_unknown_env_var_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "1")
    with pytest.raises(SettingsError, match=re.escape(name)):
        load_settings()
    with pytest.raises(SettingsError, match=re.escape(name)):
        Settings()


def test_unknown_env_vars_helper() -> None:
    env = {
        "CPKV_KV__SHARED": "0",
        "CPKV_KV": "{}",
        "cpkv_Debug": "1",
        "CPKV_KV__SHARD": "1",
        "CPKV_": "1",
        "OTHER": "1",
    }
    assert sorted(unknown_env_vars(Settings, env)) == ["CPKV_", "CPKV_KV__SHARD"]


def test_settings_error_is_a_value_error() -> None:
    assert issubclass(SettingsError, ValueError)


# --- backend preference ---------------------------------------------------------------------------


def test_effective_preference_auto_keeps_order() -> None:
    assert BackendSettings().effective_preference() == ["cuda", "triton", "torch"]


def test_effective_preference_named_backend_goes_first_once() -> None:
    b = BackendSettings(name="torch")
    assert b.effective_preference() == ["torch", "cuda", "triton"]
    assert b.preference == ["cuda", "triton", "torch"]  # not mutated


def test_effective_preference_unlisted_backend_is_prepended() -> None:
    b = BackendSettings(name="mine", preference=["triton", "torch"])
    assert b.effective_preference() == ["mine", "triton", "torch"]


def test_backend_name_from_env_feeds_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPKV_BACKEND__NAME", "cuda")
    assert load_settings().backend.effective_preference() == ["cuda", "triton", "torch"]


@pytest.mark.parametrize(("raw", "want"), [('"auto"', "auto"), ('"AUTO"', "auto"), ("4096", 4096),
                                           ("1", 1)])
def test_logits_budget_takes_auto_or_a_number(tmp_path: Path, raw: str, want: object) -> None:
    s = load_settings(_write(tmp_path, f"[runtime]\nlogits_budget_mb = {raw}\n"))
    assert s.runtime.logits_budget_mb == want


def test_logits_budget_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPKV_RUNTIME__LOGITS_BUDGET_MB", "2048")
    assert load_settings().runtime.logits_budget_mb == 2048
    monkeypatch.setenv("CPKV_RUNTIME__LOGITS_BUDGET_MB", "auto")
    assert load_settings().runtime.logits_budget_mb == "auto"


@pytest.mark.parametrize("raw", ['"lots"', '"512MiB"', "true", "-3", "1.5"])
def test_bad_logits_budget_names_the_key(tmp_path: Path, raw: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(_write(tmp_path, f"[runtime]\nlogits_budget_mb = {raw}\n"))
    msg = str(info.value)
    assert re.search(r"(^|\s)runtime\.logits_budget_mb: .*'auto'", msg, re.MULTILINE), msg


@pytest.mark.parametrize(("chunk", "page", "ok"), [(0, 64, True), (256, 64, True), (64, 64, True),
                                                   (100, 64, False), (24, 16, False),
                                                   (48, 16, True)])
def test_chunk_tokens_must_be_a_multiple_of_the_page_size(chunk: int, page: int, ok: bool) -> None:
    if ok:
        s = load_settings(runtime={"chunk_tokens": chunk}, kv={"page_size": page})
        assert s.runtime.chunk_tokens == chunk
        return
    with pytest.raises(SettingsError,
                       match=rf"runtime\.chunk_tokens: .*multiple of kv\.page_size = {page} "
                             rf"\(got {chunk}\)"):
        load_settings(runtime={"chunk_tokens": chunk}, kv={"page_size": page})


def test_negative_chunk_tokens_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"runtime\.chunk_tokens: .*\(got -64\)"):
        load_settings(_write(tmp_path, "[runtime]\nchunk_tokens = -64\n"))


def test_auto_numerics_resolve_by_the_device() -> None:
    """``kv.dtype`` / ``runtime.indexer_dtype`` "auto": fp8 pool and fp8 indexer where the device
    has fp8 tensor cores; bf16 elsewhere (the CPU defaults of before); explicit values kept."""
    auto = load_settings()
    cpu, gpu = auto.resolved(False), auto.resolved(True)
    assert (cpu.kv.pool_dtype(), cpu.runtime.indexer_dtype) == (KVDtype.BF16, "bf16")
    assert (gpu.kv.pool_dtype(), gpu.runtime.indexer_dtype) == (KVDtype.FP8, "fp8")
    assert auto.kv.dtype == "auto"  # a copy: the settings themselves are unchanged
    with pytest.raises(ValueError, match=r"kv\.dtype is 'auto'"):
        auto.kv.pool_dtype()
    bf16 = load_settings(kv={"dtype": "bf16"}).resolved(True)
    assert (bf16.kv.pool_dtype(), bf16.runtime.indexer_dtype) == (KVDtype.BF16, "bf16")
    fp8_cpu = load_settings(kv={"dtype": "fp8"}).resolved(False)
    assert (fp8_cpu.kv.pool_dtype(), fp8_cpu.runtime.indexer_dtype) == (KVDtype.FP8, "bf16")
    pinned = load_settings(runtime={"indexer_dtype": "bf16"}).resolved(True)
    assert (pinned.kv.pool_dtype(), pinned.runtime.indexer_dtype) == (KVDtype.FP8, "bf16")
    assert gpu.resolved(True) is gpu  # resolving twice changes nothing
