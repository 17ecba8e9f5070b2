"""The product reads as a product: library code and user docs name no work sessions, issues or
lent machines; every file under benchmarks/ is named by a doc, a test or the GPU driver, each
script says what it measures and how to run it; benchmarks/results/ holds only the reports
docs/perf.md cites, one per (bench, card); no doc links a file that is not there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cpkv.bench import card_name, results_name

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
PERF = DOCS / "perf.md"

LIBRARY = [ROOT / "core" / "src", *sorted((ROOT / "plugins").glob("*/src")),
           *sorted((ROOT / "backends").glob("*/src"))]

#: "session 21", "sessions 12-13", "session18/", "issue 38", "issue #12", "issue38_..."
WORK_LOG = re.compile(r"\b(sessions?|issues?)[ _-]?#?\d+", re.I)
#: the lent cards, in any case and inside file names (`gpu_h200.json`)
CARD = re.compile(r"(?<![a-z0-9])h[12]00(?![0-9])", re.I)
#: a card named in prose (perf.md's result tables and report names may name them)
CARD_WORD = re.compile(r"\bH[12]00\b")
MAX_SCRIPTS = 15


def _user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _library_files() -> list[Path]:
    return [p for src in LIBRARY for p in sorted(src.rglob("*"))
            if p.suffix in (".py", ".toml", ".md", ".txt") and "__pycache__" not in p.parts]


def _hits(path: Path, pattern: re.Pattern[str],
          keep: re.Pattern[str] | None = None) -> list[str]:
    """``path:line: text`` of every line matching ``pattern`` (and not ``keep``)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if pattern.search(line) and not (keep and keep.search(line)):
            out.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return out


def test_library_code_names_no_session_issue_or_card() -> None:
    files = _library_files()
    assert len(files) > 50  # the scan saw the tree
    bad = [h for f in files for h in _hits(f, WORK_LOG) + _hits(f, CARD)]
    assert not bad, "library code names a work session, an issue or a lent card:\n" + "\n".join(bad)


def test_user_docs_name_no_session_or_issue_and_cards_only_in_perf_tables() -> None:
    bad: list[str] = []
    for doc in _user_docs():
        bad += _hits(doc, WORK_LOG)
        if doc == PERF:  # table rows may name the card; prose names only reports (lower case)
            bad += _hits(doc, CARD_WORD, keep=re.compile(r"^\s*\|"))
        else:
            bad += _hits(doc, CARD)
    assert not bad, "user docs name a session, an issue or a card outside perf.md's tables:\n" \
        + "\n".join(bad)


def _scripts() -> list[Path]:
    return sorted(p for p in BENCH.iterdir() if p.is_file())


def _named_anywhere(name: str, exclude: Path) -> bool:
    texts = [*_user_docs(), *sorted((ROOT / "tests").glob("*.py")), BENCH / "gpu.sh"]
    return any(name in t.read_text(encoding="utf-8") for t in texts if t != exclude)


def test_every_benchmark_file_is_named_and_says_how_it_runs() -> None:
    scripts = _scripts()
    assert BENCH / "gpu.sh" in scripts
    assert 0 < len(scripts) <= MAX_SCRIPTS, [s.name for s in scripts]
    unnamed = [s.name for s in scripts if not _named_anywhere(f"benchmarks/{s.name}", s)]
    assert not unnamed, f"benchmarks/ files no doc, test or the GPU driver names: {unnamed}"
    for s in scripts:
        head = s.read_text(encoding="utf-8")[:3000]
        missing = [k for k in ("Command:", "Card:", "Writes:") if k not in head]
        assert not missing, f"benchmarks/{s.name}'s header lacks {missing}"
    subdirs = [p.name for p in BENCH.iterdir() if p.is_dir() and p.name not in ("results",
                                                                               "__pycache__")]
    assert not subdirs, f"folders under benchmarks/ besides results/: {subdirs}"


#: <bench>_<card>.json(l): card = cpu, or a GPU model token, x<n> for several
REPORT_NAME = re.compile(r"^[a-z0-9]+(_[a-z0-9]+)*_(cpu|[a-z]*\d+[a-z0-9]*(x\d+)?)\.jsonl?$")


def test_results_hold_only_reports_perf_md_cites() -> None:
    perf = PERF.read_text(encoding="utf-8")
    entries = sorted(RESULTS.iterdir())
    assert entries, "benchmarks/results/ is empty"
    for p in entries:
        assert p.is_file(), f"benchmarks/results/{p.name}: only report files, no folders"
        assert REPORT_NAME.match(p.name), f"{p.name} is not <bench>_<card>.json"
        assert p.name in perf, f"benchmarks/results/{p.name} is cited by no docs/perf.md table"
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".jsonl":
            for line in text.splitlines():
                json.loads(line)
        else:
            json.loads(text)


#: repository paths a doc names (links, code spans, prose)
PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|tests|examples|core|backends|plugins)/"
                  r"[\w./-]*\w\.(?:md|py|sh|json|jsonl|toml|png))\b")
LINK = re.compile(r"\]\(([^)#\s]+)\)")
REPORT = re.compile(r"\b([a-z0-9_]+_(?:cpu|[a-z]*\d+[a-z0-9]*(?:x\d+)?)\.jsonl?)\b")


def test_no_doc_names_a_missing_file() -> None:
    assert not (DOCS / "lessons.md").exists()
    missing: list[str] = []
    for doc in _user_docs():
        text = doc.read_text(encoding="utf-8")
        for m in PATH.finditer(text):
            if not (ROOT / m.group(1)).exists():
                missing.append(f"{doc.name}: {m.group(1)}")
        for m in LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.name}: ({target})")
    for m in REPORT.finditer(PERF.read_text(encoding="utf-8")):
        if not (RESULTS / m.group(1)).exists():
            missing.append(f"perf.md: results/{m.group(1)}")
    assert not missing, "docs name files that do not exist:\n" + "\n".join(sorted(set(missing)))


@pytest.mark.parametrize(("device", "gpus", "card"), [
    ("NVIDIA H100 80GB HBM3", 1, "h100"), ("NVIDIA H200", 2, "h200x2"),
    ("NVIDIA A100-SXM4-80GB", 1, "a100"), ("NVIDIA L40S", 1, "l40s"),
    ("Tesla V100-SXM2-16GB", 4, "v100x4"),
])
def test_reports_are_named_after_the_card(device: str, gpus: int, card: str) -> None:
    assert card_name(gpus, device) == card
    name = results_name("decode", gpus, device)
    assert name == f"benchmarks/results/decode_{card}.json"
    assert REPORT_NAME.match(Path(name).name)
