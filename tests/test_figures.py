"""Figures live in bench/baselines/<gpu>/<family>.{json,md} only (docs/CONTRIBUTING.md, "Regenerating the
baselines"): a doc cites a baseline row (file, case, provider) for a figure and never a commit, whose result
nobody keeps in step with the baselines; a comment or docstring in src/ or scripts/ states the invariant or
the reason in words and, where the reason is a measurement, cites the Decisions row of the family doc
instead of quoting the figure. Settings (a timeout, a size) are not figures.

Each file is its own test case, so a failure names the file and the lines."""
import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A commit-like word: 7 to 40 hex digits, bare or in backticks, holding at least one digit and one
# letter (so neither a plain number nor a word such as "defaced"). Hex inside a longer token (a kernel
# symbol, "0x...", a path, a case name) is not a word of its own and does not count.
_HEX = re.compile(r"(?<![\w./:#=+-])`?([0-9a-f]{7,40})`?(?![\w+-])")

# A measured figure: a number (or a range) in a unit of time, bandwidth or throughput, or seconds
# "on the H200"-style. "a 400 s timeout" is a setting and does not match.
_NUM = r"(?<![\w.])\d+(?:\.\d+)?(?:\s*(?:-|to)\s*\d+(?:\.\d+)?)?"
_FIGURE = re.compile(
    _NUM + r"\s*(?:us|µs|ms|[TG]B/s|TFLOP/s|TFLOPS|GFLOP/s)(?![\w/])"
    r"|" + _NUM + r"\s*s\s+on\s+(?:the\s+|an?\s+|one\s+)?(?:[ABH]\d{2,3}\b|development\b|GPU\b|CPU\b)",
    re.I)


def figures(text: str) -> list:
    """Every measured figure quoted in a text."""
    return [m.group(0) for m in _FIGURE.finditer(text)]


def commit_hashes(text: str) -> list:
    """(line number, word) of every commit-like word of a Markdown text."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in _HEX.finditer(line):
            word = m.group(1)
            if re.search(r"\d", word) and re.search(r"[a-f]", word):
                out.append((n, word))
    return out


def _python_notes(text: str) -> list:
    """(line number, text) of every comment and of every string that stands as a statement of its own
    (module, class and function docstrings, and the attribute docstrings beside them)."""
    notes = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            notes.extend((node.lineno + k, ln) for k, ln in enumerate(node.value.value.splitlines()))
    return notes


def _shell_notes(text: str) -> list:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        m = re.search(r"(?:^|\s)#(?!!)(.*)", line)
        if m:
            out.append((n, m.group(1)))
    return out


def measured_figures(path: Path) -> list:
    """(line number, figure) of every measured figure quoted in a comment or docstring of a file."""
    text = path.read_text()
    notes = _python_notes(text) if path.suffix == ".py" else _shell_notes(text)
    return sorted(((n, f) for n, note in notes for f in figures(note)), key=lambda hit: hit[0])


def _rel(paths) -> list:
    return sorted(str(p.relative_to(ROOT)) for p in paths)


DOCS = _rel([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
CODE = _rel([*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *(ROOT / "scripts").rglob("*.sh")])


@pytest.mark.parametrize("rel", DOCS)
def test_doc_cites_no_commit(rel):
    hits = commit_hashes((ROOT / rel).read_text())
    assert not hits, f"{rel}: cite the baseline row (bench/baselines/<gpu>/<family>.md, case, provider), not a commit: {hits}"


@pytest.mark.parametrize("rel", CODE)
def test_comments_quote_no_measured_figure(rel):
    hits = measured_figures(ROOT / rel)
    assert not hits, f"{rel}: say why in words and cite the family doc's Decisions row: {hits}"


def test_the_detectors(tmp_path):
    assert commit_hashes("grid at commits `65d06f1` and a6885c2; HEAD f98a8fe26e8465400ebf7e44570185118d3830b6") == [
        (1, "65d06f1"), (1, "a6885c2"), (1, "f98a8fe26e8465400ebf7e44570185118d3830b6")]
    # numbers, words, symbols, paths and case names are not commits
    assert commit_hashes("1234567 defaced 0x7f800000 _Z3abc1234567 a/b/ab12cd3ef.json B=64,kv=4096 e4m3 "
                         "sm90 4426950408889634 ab12cd3ef_kernel") == []
    code = tmp_path / "m.py"
    code.write_text('"""Took 359 s on the H200."""\n'
                    'X = 1  # 70-80 ms on the development CPU\n'
                    '# 1.4 TB/s, 6 GB/s and 12 us; a 400 s timeout and 2 x 117 MB are fine\n'
                    'def f():\n    """0.7 s on the development CPU."""\n    return "5 ms"\n')
    assert [f for _, f in measured_figures(code)] == [
        "359 s on the H200", "70-80 ms", "1.4 TB/s", "6 GB/s", "12 us", "0.7 s on the development"]
    shell = tmp_path / "s.sh"
    shell.write_text('#!/bin/bash\necho "3 ms"  # took 15-20 ms\n# a 600 s limit\n')
    assert measured_figures(shell) == [(2, "15-20 ms")]
