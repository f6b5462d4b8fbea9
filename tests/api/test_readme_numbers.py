"""Every measured number of README.md, and every number in the tables of docs/benchmarks.md,
comes from a file under docs/ (the JSON a script wrote, or a bench log), and equals its source as
printed (rounded to the printed decimals; a number printed with % is 100 times its source).

A table's numbers are sourced by an HTML comment right below it (invisible on the rendered page)::

    <!-- numbers (tests/api/test_readme_numbers.py)
    file: docs/bench/bench_mlp_torch.json
    labels: 1
    torch train step, 4096 => @results[shape.hidden=4096] modes.fp8_compiled.step_ms summary.best.speedup
    -->

``file:`` names the default source, ``labels:`` how many leading columns label a row (default 1:
their numbers are shapes, not measurements). A row line is a row's label (its label cells joined
by ' | ', or the start of one where no label is exactly that), ``=>``, and one key per number of
the row's other cells, left to right. A key is a path (``a.b[2].c``, ``[-1]`` from the end,
``[k=v,k2.k3=v2]`` the one list element whose fields match, ``{a[b]}`` a field whose name has brackets), ``FILE:path`` for another file,
``A/B`` for a ratio of two keys; an ``@prefix`` token prefixes the keys after it. A ``.log`` file is read as the bench
scripts print it: ``SHAPE.MODE.ms_per_step`` and ``SHAPE.MODE.kernels_per_step``.

A table without such a comment may hold no decimal number. In README's prose, a number with a
unit (x, %, s, ms, us, minutes) carries ``<!-- number: FILE:path -->`` right after it. Text in
code blocks and code spans is not checked.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = ("README.md", "docs/benchmarks.md")

NUMBER = re.compile(r"(?<![\w.])([-+]?\d+(?:\.\d+)?)(%?)")  # not inside a word (fp8, bf16, 8192x16384)
PROSE_NUMBER = re.compile(r"(?<![\w.\-/])(\d+(?:\.\d+)?)\s?(x|%|s|ms|us|minutes?)(?![\w/])")
SOURCE_BLOCK = re.compile(r"^<!-- numbers\b.*?\n(.*?)^-->", re.M | re.S)
INLINE_SOURCE = re.compile(r"\s*<!-- number: (\S+) -->")
FILE_PREFIX = re.compile(r"([\w./-]+\.(?:json|log)):")
LOG_LINE = re.compile(r"^\[(\S+)\]\s+(\S+)\s+([\d.]+) ms/step\b.*?kernels/step (\d+)", re.M)


# ---- sources -------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def load(rel: str):
    """The parsed file ``rel`` (repo-relative, under docs/): JSON, or a bench log as nested dicts."""
    path = (REPO / rel).resolve()
    assert DOCS in path.parents, f"{rel}: a source must lie under docs/"
    assert path.is_file(), f"{rel}: no such file"
    if path.suffix == ".json":
        return json.loads(path.read_text())
    assert path.suffix == ".log", f"{rel}: a source is a .json or a bench .log"
    out: dict = {}
    for shape, mode, ms, kernels in LOG_LINE.findall(path.read_text()):
        out.setdefault(shape, {})[mode] = {"ms_per_step": float(ms), "kernels_per_step": int(kernels)}
    return out


def _get_field(obj, dotted: str):
    for name in dotted.split("."):
        obj = obj[name]
    return obj


def _select(items: list, selector: str):
    if re.fullmatch(r"-?\d+", selector):
        return items[int(selector)]
    want = dict(kv.split("=", 1) for kv in selector.split(","))
    hits = [it for it in items if all(str(_get_field(it, k)) == v for k, v in want.items())]
    assert len(hits) == 1, f"[{selector}] matches {len(hits)} elements"
    return hits[0]


def lookup(key: str, default_file: str) -> float:
    """The number that ``key`` (see the module docstring) names."""
    parts = _split_ratio(key)
    if len(parts) == 2:
        return lookup(parts[0], default_file) / lookup(parts[1], default_file)
    m = FILE_PREFIX.match(key)
    rel, path = (m.group(1), key[m.end():]) if m else (default_file, key)
    obj = load(rel)
    for quoted, name, selector in re.findall(r"\{([^}]*)\}|([^.\[\]{}]+)|\[([^\]]*)\]", path):
        obj = obj[quoted or name] if quoted or name else _select(obj, selector)
    assert isinstance(obj, (int, float)) and not isinstance(obj, bool), f"{key} is {obj!r}, not a number"
    return float(obj)


def _split_ratio(key: str) -> list[str]:
    """``A/B`` as [A, B] (each with its own FILE: prefix or none); a key whose only '/' lie in
    its FILE: prefix stays whole."""
    m = FILE_PREFIX.match(key)
    at = key.find("/", m.end() if m else 0)
    if at < 0:
        return [key]
    return [key[:at], key[at + 1:]]


def printed_as(value: float, text: str, percent: bool) -> bool:
    """Whether ``value`` (times 100 for a percentage) rounds to ``text``, at its decimals."""
    decimals = len(text.split(".", 1)[1]) if "." in text else 0
    shown = f"{value * 100 if percent else value:.{decimals}f}"
    return float(shown) == float(text)


# ---- pages ----------------------------------------------------------------------------------------
def _without_code(text: str) -> str:
    """``text`` with fenced blocks and code spans blanked (line structure kept)."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "``", text)


def tables(text: str) -> list[tuple[int, list[list[str]], str | None]]:
    """(line, rows of cells without the header separator, the source block below or None)."""
    lines = text.split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            start, rows = i, []
            while i < len(lines) and lines[i].startswith("|"):
                if i != start + 1:
                    rows.append([c.strip() for c in lines[i].strip()[1:-1].split("|")])
                i += 1
            below = "\n".join(lines[i:])
            m = SOURCE_BLOCK.match(below.lstrip("\n"))
            out.append((start + 1, rows, m.group(1) if m else None))
        else:
            i += 1
    return out


def _plain(cell: str) -> str:
    return cell.replace("**", "").strip()


def check_table(rows: list[list[str]], block: str) -> list[str]:
    """The table's problems (empty when every number of every row equals its source)."""
    default, n_labels, specs = None, 1, []
    for line in block.strip().splitlines():
        if line.startswith("file:"):
            default = line.split(":", 1)[1].strip()
        elif line.startswith("labels:"):
            n_labels = int(line.split(":", 1)[1])
        elif "=>" in line:
            label, keys = line.split("=>", 1)
            specs.append((label.strip(), default, keys.split()))
        elif line.strip():
            return [f"cannot read the source line {line!r}"]
    problems, used = [], set()
    for cells in rows[1:]:  # rows[0]: the header
        label = " | ".join(_plain(c) for c in cells[:n_labels])
        numbers = [(m.group(1), bool(m.group(2)))
                   for c in cells[n_labels:] for m in NUMBER.finditer(_plain(c))]
        if not numbers:
            continue
        hits = [k for k, s in enumerate(specs) if label == s[0]] or \
            [k for k, s in enumerate(specs) if label.startswith(s[0])]
        if len(hits) != 1:
            problems.append(f"row {label!r}: {len(hits)} source lines match it")
            continue
        used.add(hits[0])
        _, rel, tokens = specs[hits[0]]
        prefix, keys = "", []
        for t in tokens:
            if t.startswith("@"):
                prefix = t[1:] + "."
            else:
                keys.append("/".join(k if FILE_PREFIX.match(k) else prefix + k for k in _split_ratio(t)))
        if len(keys) != len(numbers):
            problems.append(f"row {label!r}: {len(keys)} keys for the numbers {[n for n, _ in numbers]}")
            continue
        for (text, percent), key in zip(numbers, keys):
            try:
                value = lookup(key, rel)
            except (KeyError, IndexError, AssertionError, TypeError) as e:
                problems.append(f"row {label!r}: {key}: {e!r}")
                continue
            if not printed_as(value, text, percent):
                problems.append(f"row {label!r}: printed {text}{'%' if percent else ''}, {key} is {value!r}")
    problems += [f"source line {specs[k][0]!r} matches no row" for k in range(len(specs)) if k not in used]
    return problems


def _table_params():
    for page in PAGES:
        for line, rows, block in tables(_without_code((REPO / page).read_text())):
            yield pytest.param(page, rows, block, id=f"{page}:{line}")


@pytest.mark.parametrize("page, rows, block", list(_table_params()))
def test_every_number_of_a_table_is_its_sources(page, rows, block):
    if block is None:
        decimals = [c for r in rows[1:] for c in r[1:] if re.search(r"(?<![\w.])\d+\.\d+", c)]
        assert not decimals, f"measured numbers {decimals[:3]}: the table needs a '<!-- numbers' block below"
        return
    assert check_table(rows, block) == []


def test_readme_prose_numbers_carry_their_source():
    text = _without_code((REPO / "README.md").read_text())
    text = re.sub(r"^\|.*$", "", text, flags=re.M)  # tables: above
    text = SOURCE_BLOCK.sub("", text)
    problems, checked = [], 0
    for m in PROSE_NUMBER.finditer(text):
        if text.startswith("<!--", text.rfind("\n", 0, m.start()) + 1):
            continue
        src = INLINE_SOURCE.match(text, m.end())
        if not src:
            problems.append(f"{m.group(0)!r} has no '<!-- number: FILE:path -->' after it")
            continue
        value = lookup(src.group(1), "")
        if not printed_as(value, m.group(1), m.group(2) == "%"):
            problems.append(f"{m.group(0)!r}: {src.group(1)} is {value!r}")
        checked += 1
    assert problems == []
    assert checked >= 1  # the CPU figures of the flax block and the demo are sourced


def test_the_checks_can_fail():
    """Control: a wrong number, a missing key and an unsourced row are each reported."""
    rows = [["case", "value"], ["row a", "1.23 (4.0x)"], ["row b", "7"]]
    block = ("file: docs/bench/bench_mlp_torch_1024.json\n"
             "row a => results[0].modes.bf16_eager.step_ms results[0].summary.best.speedup\n")
    problems = check_table(rows, block)
    assert any("printed 1.23" in p for p in problems) and any("printed 4.0" in p for p in problems)
    assert any("row 'row b': 0 source lines" in p for p in problems)
    assert check_table(rows[:2], block.replace("step_ms ", "step_ms results[0].nothing ")) != []
    good = json.loads((DOCS / "bench" / "bench_mlp_torch_1024.json").read_text())["results"][0]
    rows = [["case", "value"], ["row a", f"{good['modes']['bf16_eager']['step_ms']:.3f} "
                                         f"({good['summary']['best']['speedup']:.2f}x)"]]
    assert check_table(rows, block) == []
