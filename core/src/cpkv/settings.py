"""Run settings of cpkv: one pydantic-settings model, read from keyword arguments, ``CPKV_*``
environment variables and an optional TOML file (in that priority order).

Every section is closed (``extra="forbid"``) and every ``CPKV_*`` variable must name a real key, so a
misspelt key is an error that names its location instead of a silently ignored value. Use
:func:`load_settings` to pick the TOML file at run time; ``Settings()`` reads keywords and the
environment only.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)
from pydantic_settings import SettingsError as _SourceError

from cpkv.contracts import BufferLayout, FallbackPolicy, KVDtype, MaterializeMode, SplitMode

__all__ = [
    "BackendSettings",
    "CPSettings",
    "CacheSettings",
    "DecodeSettings",
    "FallbackSettings",
    "KVSettings",
    "LogSettings",
    "PluginSettings",
    "PluginTable",
    "RunSettings",
    "RuntimeSettings",
    "Settings",
    "SettingsError",
    "SettingsProblem",
    "TransferSettings",
    "load_settings",
    "origin_of",
    "unknown_env_vars",
]

ENV_PREFIX = "CPKV_"
ENV_NESTED_DELIMITER = "__"


def _refusing(value: object, why: str) -> Any:
    """A field validator (a classmethod for :func:`pydantic.field_validator`) that refuses
    ``value`` with ``why``."""

    def check(cls: type, v: Any) -> Any:
        if v is value:
            raise ValueError(why)
        return v

    return classmethod(check)


@dataclass(frozen=True)
class SettingsProblem:
    """One wrong settings value, for a caller that words its own message (the CLI names its
    option where the value came from one).

    Attributes:
        key: the dotted location, e.g. ``runtime.chunk_tokens``.
        message: what is wrong and, where known, the fix (``unknown key; did you mean
            runtime.timeout_s?``), without the key or the source.
        origin: where the value came from: ``keyword arguments``, ``environment variable
            CPKV_...``, the TOML file's path, or ``defaults``.
    """

    key: str
    message: str
    origin: str


class SettingsError(ValueError):
    """Settings could not be loaded: missing or malformed TOML file, unknown key or ``CPKV_*``
    variable, or a value that fails validation. The message names the location and the source;
    :attr:`problems` holds the wrong values one by one (empty for a file that cannot be read)."""

    def __init__(self, message: str, problems: Sequence[SettingsProblem] = ()) -> None:
        super().__init__(message)
        self.problems: tuple[SettingsProblem, ...] = tuple(problems)


class _Section(BaseModel):
    """Base of every settings section: closed, so a misspelt key is an error."""

    model_config = ConfigDict(extra="forbid")


class CPSettings(_Section):
    """Context-parallel group."""

    size: int = Field(2, ge=1, description="CP group size C (ranks that split one prefill)")
    mode: SplitMode = Field(SplitMode.ZIGZAG, description="how extend tokens and pages are split")


class KVSettings(_Section):
    """KV pool layout."""

    shared: bool = Field(
        True, description="one owner per page; False keeps a full replica on every rank (baseline)"
    )
    dtype: KVDtype | Literal["auto"] = Field(
        "auto", description="pool storage format: 'bf16', 'fp8' (DeepSeek's deployed format: "
                            "e4m3 latent with per-128 scales, Hadamard-rotated e4m3 index-K with "
                            "a power-of-two scale), 'fp32', or 'auto': fp8 where the run's "
                            "device has fp8 tensor cores (CUDA sm89+: Ada, Hopper and later), "
                            "bf16 elsewhere (CPUs)")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        # one message for a bad value (the union reports one error per member)
        if isinstance(v, str) and not isinstance(v, KVDtype):
            v = v.strip().lower()
            if v != "auto" and v not in {d.value for d in KVDtype}:
                raise ValueError(f"must be 'auto' or one of {[d.value for d in KVDtype]}")
        return v

    def pool_dtype(self) -> KVDtype:
        """``dtype`` once resolved (:meth:`Settings.resolved`).

        Raises:
            ValueError: ``dtype`` is still ``"auto"``.
        """
        if self.dtype == "auto":
            raise ValueError("kv.dtype is 'auto': resolve it for the run's device first "
                             "(Settings.resolved)")
        return KVDtype(self.dtype)
    page_size: int = Field(64, ge=1, description="tokens per KV page")
    pages_per_rank: int = Field(4096, ge=1, description="pool capacity per rank, in pages")
    materialize: MaterializeMode = Field(
        MaterializeMode.AUTO,
        description="how a sharded pool builds the full view: 'all_gather' (owned pages into a "
                    "send buffer, one all-gather; kernels read the receive buffer in place), "
                    "'p2p' (pages kept in peer-mapped memory, read from their owners in one pass; "
                    "symmetric memory over NVLink on CUDA, shared memory on CPU) or 'auto' (p2p "
                    "on GPUs whose ranks map each other's memory, else all_gather)",
    )

    layout: BufferLayout = Field(
        BufferLayout.TOKEN_MAJOR,
        description="how a page's bytes lie in the pool's tensors: 'token_major' (one tensor "
                    "per layer, each token's latent then index-K; every strategy reads it), "
                    "'part_major' (one tensor per layer, a page's latent rows then its index-K "
                    "rows: FlashMLA's fp8 decode reads it in place; replica and all_gather "
                    "only) or 'two_part' (the engines' layout: per layer a latent tensor and an "
                    "index-K tensor in DeepGEMM's page order; replica and all_gather only). The "
                    "decode rank's pool has its own (decode.layout)",
    )

    _sharded_mode = field_validator("materialize")(_refusing(
        MaterializeMode.REPLICA, "'replica' is what kv.shared = false selects; a sharded pool "
        "builds its views with 'all_gather', 'p2p' or 'auto'"))


class BackendSettings(_Section):
    """Kernel backend selection."""

    name: str = Field("auto", min_length=1, description="a backend entry-point name, or 'auto'")
    preference: list[str] = Field(
        default_factory=lambda: ["cuda", "triton", "torch"],
        min_length=1,
        description="backends tried in this order, per op; with name 'auto' one that cannot run "
                    "here or lacks an op is passed over quietly (info log, the run's report)",
    )

    def effective_preference(self) -> list[str]:
        """The order backends are tried in: ``preference``, or ``[name]`` followed by the rest of
        ``preference`` (without repeating ``name``) when ``name`` is not ``"auto"``."""
        if self.name == "auto":
            return list(self.preference)
        return [self.name, *(p for p in self.preference if p != self.name)]


M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class PluginTable:
    """A plugin-owned settings table (``[transfer.<plugin>]``) as the core forwards it: the raw
    values and where each came from. The plugin validates it once, with its own model
    (:meth:`parse`).

    Attributes:
        key: the table's dotted location, e.g. ``("transfer", "mooncake")``.
        values: the keys as given (strings from ``CPKV_*`` variables are not converted yet).
        origins: key -> its source (a file path, an environment variable, keyword arguments).
    """

    key: tuple[str, ...] = ()
    values: Mapping[str, Any] = field(default_factory=dict)
    origins: Mapping[str, str] = field(default_factory=dict)

    def parse(self, model: type[M]) -> M:
        """``model`` validated from :attr:`values` (make it closed, ``extra="forbid"``, so a
        misspelt key is an error).

        Raises:
            SettingsError: a value fails validation, or a key is unknown; one line per error with
                the key's dotted location (``transfer.mooncake.retries``) and its source.
        """
        try:
            return model.model_validate(dict(self.values))
        except ValidationError as exc:
            problems = [_problem(err, (*self.key, *map(str, err["loc"])),
                                 self.origins.get(str(err["loc"][0]) if err["loc"] else "",
                                                  "defaults"),
                                 _suggest(model, [str(p) for p in err["loc"]], self.key))
                        for err in exc.errors()]
            raise SettingsError(f"invalid cpkv settings [{'.'.join(self.key)}]:\n"
                                + "\n".join(map(_error_line, problems)), problems) from exc


def _plugin_table(value: Any) -> Any:
    if not isinstance(value, Mapping):
        raise ValueError("not a [transfer] setting (name, timeout_s, pipeline, max_inflight_mb); a "
                         "transfer plugin's own settings go in its table, e.g. [transfer.mooncake]")
    return value


class TransferSettings(_Section):
    """Cross-rank page transfer: the core's keys, and one table per transfer plugin for the
    plugin's own keys (``[transfer.mooncake]``), which the plugin validates itself."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("nccl", min_length=1, description="a transfer entry-point name")
    timeout_s: float = Field(
        30.0, gt=0, description="bound on the silence of a transfer wait, seconds: a wait for a "
                                "message or part fails (TransferTimeout, naming what each rank "
                                "does) when no other rank made progress for this long; a prefill "
                                "of any length does not count against it")
    pipeline: Literal["request", "layer"] = Field(
        "request", description="'request': each rank sends a request's pages after its prefill; "
                               "'layer': it sends layer l's pages as soon as layer l's KV is "
                               "written, during the prefill")
    max_inflight_mb: int = Field(
        256, ge=1, description="queued send bytes per prefill rank past which the layer loop "
                               "waits for its sender (MiB)")

    #: plugin-owned tables, ``[transfer.<plugin>]`` (e.g. ``[transfer.mooncake]``): kept as
    #: given, validated by that plugin's own model when it connects (:meth:`Settings.transfer_table`)
    __pydantic_extra__: dict[str, Annotated[dict[str, Any], BeforeValidator(_plugin_table)]] = Field(
        init=False)

    #: table -> key -> where its value came from (set by :class:`Settings`)
    _origins: dict[str, dict[str, str]] = PrivateAttr(default_factory=dict)

    def record_origins(self, origins: dict[str, dict[str, str]]) -> None:
        """Remember where each plugin table's keys came from (table -> key -> source), for the
        plugins' error messages; :class:`Settings` calls it once after validation."""
        self._origins = origins

    def tables(self) -> dict[str, dict[str, Any]]:
        """The plugin-owned tables, by plugin name."""
        return dict(self.model_extra or {})

    def table(self, name: str) -> PluginTable:
        """Plugin ``name``'s table (empty when the settings have none), as the core forwards it."""
        values = self.tables().get(name, {})
        origins = self._origins.get(name, {})
        return PluginTable(("transfer", name), dict(values),
                           {k: origins.get(k, "keyword arguments") for k in values})


class PluginSettings(_Section):
    """Plugin discovery."""

    disable: list[str] = Field(default_factory=list, description="entry-point names never loaded")
    allow: list[str] | None = Field(None, description="if set, only these entry-point names load")


class FallbackSettings(_Section):
    """Fallback handling (contract rule 30)."""

    policy: FallbackPolicy = Field(
        FallbackPolicy.WARN, description="'warn': log and continue; 'error': raise"
    )


class RuntimeSettings(_Section):
    """Runtime bounds."""

    timeout_s: float = Field(
        120.0, gt=0, description="bound on silence, seconds: when no rank makes progress (a layer, "
                                 "a row chunk, a decode step) for this long the job is stopped and "
                                 "the ranks that made none are named; a job that makes progress "
                                 "is never stopped. Under torchrun also each collective's bound")
    startup_timeout_s: float = Field(
        60.0, gt=0, description="bound on starting the rank processes (interpreter, imports) and "
                                "joining the process group, seconds; raise it when the machine "
                                "has fewer CPU cores than processes")
    logits_budget_mb: int | Literal["auto"] = Field(
        "auto", description="indexer logits/scratch memory budget per row chunk, MiB (>= 1), or "
                            "'auto': on CUDA an eighth of the device memory free once the model "
                            "and pool are allocated, clamped to [512, 16384] MiB; 512 on CPUs")
    chunk_tokens: int = Field(
        0, ge=0, description="chunked prefill: a request whose extend is longer than this is "
                             "prefilled in chunks of at most this many tokens, one batch each, "
                             "their boundaries on pages; 0 = off. A multiple of kv.page_size")
    prefetch: bool = Field(
        True, description="gather the next layer's cached prefix pages while this layer computes"
    )
    indexer_dtype: Literal["auto", "bf16", "fp8"] = Field(
        "auto", description="the indexer's queries: 'fp8' quantizes them as DeepSeek-V3.2 does "
                            "(rotated, e4m3 per row and head with a power-of-two scale folded "
                            "into the head weights) when the pool's index keys are fp8, for fp8 "
                            "x fp8 tensor cores; 'bf16' keeps the model dtype; 'auto': fp8 where "
                            "the pool is fp8 and the device has fp8 tensor cores (CUDA sm89+), "
                            "bf16 elsewhere",
    )
    warmup_tokens: int = Field(
        0, ge=0, description="warm-up when a prefill session starts: prefill synthetic prompts "
                             "that reach every compiled kernel variant up to this many tokens "
                             "(one of this length less one, odd, in the session's chunks, and a "
                             "short one), then release them, so no request waits on a compile; "
                             "its time is in the report. The longest prompt served; 0 = off, "
                             "else >= 2 (cpkv.runtime.warmup; `cpkv warmup` does it alone)")

    @field_validator("warmup_tokens")
    @classmethod
    def _warmup(cls, v: int) -> int:
        if v == 1:
            raise ValueError("must be 0 (off) or >= 2 (the longest prompt the session serves)")
        return v

    @field_validator("logits_budget_mb", mode="before")
    @classmethod
    def _budget(cls, v: Any) -> int | str:
        # one clear message for every bad value (a plain union reports one error per member)
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v.strip())  # an environment variable
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError("must be a whole number of MiB >= 1 or 'auto'")
        return v


class DecodeSettings(_Section):
    """The decode rank's steps (:class:`~cpkv.runtime.decode.DecodeWorker`)."""

    cuda_graphs: bool = Field(
        True, description="on CUDA, capture each decode step shape (batch bucket x block-table "
                          "width) once in a CUDA graph and replay it; false: eager steps "
                          "(reported as fallback decode_eager). CPUs always run eagerly")
    max_batch: int = Field(
        128, ge=1, description="the largest batch bucket captured (buckets are the powers of two "
                               "up to it); a larger batch runs eagerly")
    layout: BufferLayout = Field(
        BufferLayout.TWO_PART,
        description="the decode rank's pool layout, which its kernels read in place: 'two_part' "
                    "(the engines' layout: index-K in DeepGEMM's page order, 16-byte key rows "
                    "the paged indexer streams at 1.2x the speed of part-major's 132-byte "
                    "rows; FlashMLA reads the latent tensor) or 'part_major' (one tensor per "
                    "layer, a page's latent rows then its index-K rows)")


    _read_in_place = field_validator("layout")(_refusing(
        BufferLayout.TOKEN_MAJOR, "the decode rank's kernels read 'two_part' or 'part_major' "
        "pages in place, not 'token_major'"))


class LogSettings(_Section):
    """Logging of the ``cpkv`` command (the library itself never configures logging)."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "warning", description="events logged (stderr) from this level up, the rank processes' "
                               "included; -v (info), -vv (debug) and -q (error) override it")


class CacheSettings(_Section):
    """Prefix cache over the sharded pool (rule 28)."""

    enabled: bool = Field(
        True, description="radix prefix cache: a new request starts from the longest cached "
                          "prefix of its tokens (a hit may end inside a page); finished requests "
                          "stay cached until pool pressure evicts them, least recently used first",
    )
    host_pages: int = Field(
        0, ge=0, description="host tier capacity, in pages per rank (pinned memory on GPUs): an "
                             "evicted prefix is backed up there by its pages' owners and loaded "
                             "back on a hit; 0 turns the host tier off (evicted pages are gone)",
    )
    eviction: Literal["lru", "none"] = Field(
        "lru", description="'lru': a batch that does not fit evicts the least recently used "
                           "cached prefixes first; 'none': cached prefixes stay until released "
                           "and such a batch fails (PoolExhausted)",
    )
    v4_prefix: bool = Field(
        False, description="DeepSeek-V4 (cpkv run on a V4 checkpoint): serve the prompts in order "
                           "through the V4 prefix cache; a hit resumes from the last snapshot "
                           "boundary at or before it and recomputes the tokens after it",
    )
    v4_snapshot_tokens: int = Field(
        2048, ge=0, description="DeepSeek-V4 prefix cache: keep a snapshot (window rows and "
                                "compressor state) every this many tokens, rounded up to a "
                                "multiple of the ownership unit, besides one at each request's "
                                "last unit boundary; 0: only those",
    )


class RunSettings(_Section):
    """The main job (``cpkv run``)."""

    model: str = Field("tiny", min_length=1,
                       description="checkpoint directory, or 'tiny' (a small random model)")
    prompts: str | None = Field(None, description="JSON file with a list of token-id lists")
    batch_size: int = Field(1, ge=1, description="prompts per prefill batch, served in order "
                                                 "(each can hit what earlier batches cached)")
    mtp: bool = Field(False, description="run the checkpoint's MTP draft layer under CP prefill "
                                         "and decode speculatively on the decode rank")
    draft_tokens: int = Field(1, ge=1, le=8, description="with mtp: draft tokens verified per "
                                                         "decode step (k > 1 chains the MTP layer)")
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="where the job runs: 'cpu' (Gloo ranks, float32 model), 'cuda' (NCCL "
                           "ranks, rank r on GPU r, bfloat16 model, the reference on GPU 0) or "
                           "'auto' (cuda when there is a GPU per process, else cpu)")
    reference: Literal["full", "sample", "off"] = Field(
        "sample", description="the one-rank reference check: 'full' computes every prompt whole "
                              "on one rank (logits, top-k sets, decode tokens checked); 'sample' "
                              "computes each prompt up to reference_tokens (a prompt no longer "
                              "is checked whole; a longer one on its first reference_tokens "
                              "rows' top-k sets in every layer, its last-token logits and decode "
                              "tokens unchecked); 'off' checks nothing. The report says which")
    reference_tokens: int = Field(
        32768, ge=1, description="with reference = 'sample': tokens of each prompt the "
                                 "reference computes")


# The TOML file of the load in progress. A context variable, not a class attribute, so concurrent
# loads in different threads or tasks never see each other's file and nothing outlives the call.
_toml_path: ContextVar[Path | None] = ContextVar("cpkv_settings_toml", default=None)


@contextmanager
def _bound_toml(path: Path | None) -> Iterator[None]:
    token = _toml_path.set(path)
    try:
        yield
    finally:
        _toml_path.reset(token)


class _UnknownEnvCheck(PydanticBaseSettingsSource):
    """A source that contributes nothing and raises on a ``CPKV_*`` variable naming no key
    (pydantic-settings would ignore it)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def _problem(self, name: str) -> SettingsProblem:
        """``CPKV_RUNTIME__TIMOUT_S``: no such key, did you mean ``CPKV_RUNTIME__TIMEOUT_S``?"""
        parts = name[len(ENV_PREFIX):].lower().split(ENV_NESTED_DELIMITER)
        near = _suggest(self.settings_cls, parts)
        msg = "no such settings key" + (
            f"; did you mean {ENV_PREFIX}{near.upper().replace('.', ENV_NESTED_DELIMITER)}?"
            if near else "")
        return SettingsProblem(".".join(parts), msg, f"environment variable {name}")

    def __call__(self) -> dict[str, Any]:
        unknown = sorted(unknown_env_vars(self.settings_cls, os.environ))
        if unknown:
            problems = [self._problem(name) for name in unknown]
            raise SettingsError(
                "unknown cpkv environment variable(s): " + ", ".join(
                    f"{p.origin.removeprefix('environment variable ')} ({p.message})"
                    for p in problems)
                + f"; keys are {ENV_PREFIX}<SECTION>{ENV_NESTED_DELIMITER}<KEY>", problems)
        return {}


def _resolves(model: type[BaseModel], parts: list[str]) -> bool:
    """True when ``parts`` (lower case) is a path to a field of ``model`` or of its sections."""
    if not parts:
        return False
    field = model.model_fields.get(parts[0])
    if field is None:  # a key of a plugin-owned table (``[transfer.<plugin>]``)
        return model.model_config.get("extra") == "allow" and len(parts) >= 2
    rest = parts[1:]
    if not rest:
        return True
    ann = field.annotation
    return isinstance(ann, type) and issubclass(ann, BaseModel) and _resolves(ann, rest)


def unknown_env_vars(model: type[BaseModel], environ: Mapping[str, str] | None = None) -> list[str]:
    """Names of ``CPKV_*`` variables in ``environ`` (default ``os.environ``) that name no field of
    ``model`` (compared case-insensitively, sections split on ``__``)."""
    environ = os.environ if environ is None else environ
    out = []
    for name in environ:
        if not name.upper().startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split(ENV_NESTED_DELIMITER)
        if not _resolves(model, parts):
            out.append(name)
    return out


def _problem(err: ErrorDetails, loc: Sequence[str], origin: str,
             suggestion: str | None = None) -> SettingsProblem:
    """A validation error as a :class:`SettingsProblem`: pydantic's message (an unknown key said
    so, with the closest real key when one is close), and the value given."""
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key" + (f"; did you mean {suggestion}?" if suggestion else "")
    elif msg:
        msg = msg[0].lower() + msg[1:]
    if err["type"] not in ("missing", "extra_forbidden"):
        msg += f" (got {err['input']!r})"
    return SettingsProblem(".".join(loc), msg, origin)


def _error_line(problem: SettingsProblem) -> str:
    """``  dotted.location: message (got value) [from origin]``."""
    return f"  {problem.key}: {problem.message} [from {problem.origin}]"


def _dotted_keys(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[str]:
    """Every dotted key of ``model``: its sections and their fields."""
    out = []
    for name, f in model.model_fields.items():
        out.append(".".join((*prefix, name)))
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _dotted_keys(ann, (*prefix, name))
    return out


def _suggest(model: type[BaseModel], loc: Sequence[str], prefix: Sequence[str] = ()) -> str | None:
    """The real key closest to the unknown one at ``loc`` in ``model`` (a misspelling, or a key
    put in the wrong section: ``run.timeout_s`` -> ``runtime.timeout_s``), or None."""
    wrong = ".".join(loc)
    close = difflib.get_close_matches(wrong, _dotted_keys(model), n=1, cutoff=0.7)
    if not close:  # a real key name under another section
        leaf = [k for k in _dotted_keys(model) if k.rsplit(".", 1)[-1] == loc[-1]]
        close = leaf[:1] if len(leaf) == 1 else []
    return ".".join((*prefix, close[0])) if close else None


def _describe(exc: ValidationError, init: Mapping[str, Any],
              toml: Path | None) -> tuple[str, list[SettingsProblem]]:
    """One line per error: dotted location, message, bad value, and where it came from."""
    problems = [_problem(err, [str(p) for p in err["loc"]], origin_of(err["loc"], init, toml),
                         _suggest(Settings, [str(p) for p in err["loc"]]))
                for err in exc.errors()]
    where = f"file {toml}" if toml is not None else "no file"
    return (f"invalid cpkv settings ({where}):\n" + "\n".join(map(_error_line, problems)),
            problems)


def origin_of(loc: Sequence[Any], init: Mapping[str, Any], toml: Path | None) -> str:
    """Best guess of the source of the value at ``loc`` (``("runtime", "chunk_tokens")``),
    following the priority order: ``keyword arguments`` (in ``init``), ``environment variable
    CPKV_...``, the path ``toml``, else ``environment``."""
    keys = [str(p) for p in loc]

    def has(data: Any) -> bool:
        for k in keys:
            if isinstance(data, BaseModel):
                data = {**data.__dict__, **(data.model_extra or {})}
            if not isinstance(data, Mapping) or k not in data:
                return False
            data = data[k]
        return True

    if has(init):
        return "keyword arguments"
    env_name = ENV_PREFIX + ENV_NESTED_DELIMITER.join(keys).upper()
    for name in os.environ:
        if name.upper() == env_name or (
            name.upper().startswith(ENV_PREFIX)
            and env_name.startswith(name.upper() + ENV_NESTED_DELIMITER)
        ):
            return f"environment variable {name}"
    if toml is not None:
        return str(toml)
    return "environment"


class Settings(BaseSettings):
    """All cpkv run settings.

    Priority: keyword arguments, then ``CPKV_*`` environment variables (sections split on ``__``,
    e.g. ``CPKV_KV__SHARED=false``), then the TOML file given to :func:`load_settings`, then
    defaults.

    Raises:
        SettingsError: on a value that fails validation, an unknown key, or an unknown ``CPKV_*``
            environment variable; the message names the dotted location and the source.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        extra="forbid",
    )

    debug: bool = Field(False, description="device-syncing checks (rule 31); CPKV_DEBUG=1")
    cp: CPSettings = Field(default_factory=CPSettings)
    kv: KVSettings = Field(default_factory=KVSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    transfer: TransferSettings = Field(default_factory=TransferSettings)
    plugins: PluginSettings = Field(default_factory=PluginSettings)
    fallback: FallbackSettings = Field(default_factory=FallbackSettings)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    run: RunSettings = Field(default_factory=RunSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    log: LogSettings = Field(default_factory=LogSettings)

    def __init__(self, **values: Any) -> None:
        """Build settings from ``values`` (highest priority), the environment and the bound TOML.

        Raises:
            SettingsError: see the class docstring.
        """
        toml = _toml_path.get()
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(*_describe(exc, values, toml)) from exc
        except _SourceError as exc:  # e.g. a list-valued CPKV_* variable that is not JSON
            raise SettingsError(f"invalid cpkv settings: {exc}") from exc
        # the plugins validate their tables later (at connect): remember where each key came from
        self.transfer.record_origins({
            name: {k: origin_of(("transfer", name, k), values, toml) for k in table}
            for name, table in self.transfer.tables().items()})
        problem = self.cross_section_problem()
        if problem is not None:
            where = f"file {toml}" if toml is not None else "no file"
            key, _, msg = problem.partition(": ")
            raise SettingsError(f"invalid cpkv settings ({where}):\n  {problem}",
                                [SettingsProblem(key, msg, origin_of(key.split("."), values,
                                                                     toml))])

    def transfer_table(self) -> PluginTable:
        """The selected transfer plugin's table, ``[transfer.<transfer.name>]``."""
        return self.transfer.table(self.transfer.name)

    def cross_section_problem(self) -> str | None:
        """Why values of different sections cannot work together (None: they can): a
        ``runtime.chunk_tokens`` that is not a multiple of ``kv.page_size`` (non-final chunks
        must end on a page boundary, so they write and send whole pages only: rule 26)."""
        n, ps = self.runtime.chunk_tokens, self.kv.page_size
        if n and n % ps:
            return (f"runtime.chunk_tokens: must be 0 (off) or a multiple of kv.page_size = {ps} "
                    f"(got {n})")
        return None

    def resolved(self, fp8_tensor_cores: bool) -> Settings:
        """These settings with every ``"auto"`` numeric format decided for a device that has
        (or lacks) fp8 tensor cores: ``kv.dtype`` fp8 there, else bf16; then
        ``runtime.indexer_dtype`` fp8 where the pool is fp8 and the device has them, else
        bf16. Explicit values are kept. A pure function of the settings and the flag, so
        every rank that resolves alike decides alike."""
        kv, rt = self.kv, self.runtime
        dtype = kv.dtype if kv.dtype != "auto" else (KVDtype.FP8 if fp8_tensor_cores
                                                     else KVDtype.BF16)
        idx = rt.indexer_dtype
        if idx == "auto":
            idx = "fp8" if fp8_tensor_cores and dtype == KVDtype.FP8 else "bf16"
        if (dtype, idx) == (kv.dtype, rt.indexer_dtype):
            return self
        return self.model_copy(update={"kv": kv.model_copy(update={"dtype": dtype}),
                                       "runtime": rt.model_copy(update={"indexer_dtype": idx})})

    def with_cp_size(self, size: int) -> Settings:
        """These settings for a CP group of ``size`` ranks (e.g. 1: a decode rank, the
        single-rank reference); every other value unchanged."""
        return self.model_copy(update={"cp": self.cp.model_copy(update={"size": size})})

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Init kwargs, then environment, then the TOML file bound by :func:`load_settings`.

        No dotenv and no secrets directory.
        """
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            _UnknownEnvCheck(settings_cls),
            env_settings,
        ]
        toml = _toml_path.get()
        if toml is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml))
        return tuple(sources)


def load_settings(path: str | os.PathLike[str] | None = None, **overrides: Any) -> Settings:
    """Load settings from ``overrides``, ``CPKV_*`` environment variables and the TOML file
    ``path`` (in that priority order), falling back to defaults.

    ``overrides`` are top-level keys: ``debug=True`` or ``kv={"shared": False}`` (merged with the
    other sources key by key).

    Raises:
        SettingsError: when ``path`` does not exist or is not a file, is not valid TOML, holds an
            unknown key or a bad value, or when a ``CPKV_*`` variable names no key.
    """
    toml: Path | None = None
    if path is not None:
        toml = Path(path)
        if not toml.is_file():
            raise SettingsError(f"cpkv settings file not found: {toml}")
        try:
            with toml.open("rb") as f:
                tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"cpkv settings file {toml} is not valid TOML: {exc}") from exc
        except OSError as exc:
            raise SettingsError(f"cpkv settings file {toml} cannot be read: {exc}") from exc
    with _bound_toml(toml):
        return Settings(**overrides)
