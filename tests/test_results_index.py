"""bench/results/README.md indexes the results: every top-level entry of bench/results/ is named there,
every path it links to exists, the top level stays at most 30 entries, and each benchmark's default
--out folder is one the index names."""

from __future__ import annotations

import ast
import re

from conftest import REPO

RESULTS = REPO / "bench" / "results"
INDEX = RESULTS / "README.md"


def linked(text: str) -> set[str]:
    """The relative paths the index's Markdown links name (within bench/results/)."""
    return {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t}


def test_every_entry_is_indexed_and_every_indexed_path_exists():
    paths = linked(INDEX.read_text())
    entries = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    assert len(entries) + 1 <= 30, f"bench/results/ has {len(entries) + 1} entries (30 at most): file them in folders"
    named = {p.rstrip("/").split("/")[0] for p in paths}
    assert not set(entries) - named, f"not in bench/results/README.md: {sorted(set(entries) - named)}"
    missing = sorted(p for p in paths if not (RESULTS / p).exists())
    assert not missing, f"bench/results/README.md names what does not exist: {missing}"


def test_each_benchmarks_default_out_is_an_indexed_folder():
    named = {p.rstrip("/") for p in linked(INDEX.read_text())}
    defaults = {}
    for script in sorted((REPO / "bench").glob("*.py")):
        for call in ast.walk(ast.parse(script.read_text())):
            if (isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument"
                    and call.args and getattr(call.args[0], "value", None) == "--out"):
                default = next((k.value for k in call.keywords if k.arg == "default"), None)
                text = ast.unparse(default) if default is not None else ""
                found = re.search(r"bench/results/([\w-]+)|results['\"]? / ['\"]([\w-]+)", text, re.IGNORECASE)
                if "results" in text.lower():
                    defaults[script.name] = next(g for g in found.groups() if g) if found else text
    assert {"attention.py", "scale.py", "scale_plan.py", "tokenize_pack.py"} <= set(defaults)
    stray = {name: folder for name, folder in defaults.items() if folder not in named}
    assert not stray, f"--out defaults outside the index's folders: {stray}"


def test_links_are_read_as_the_index_writes_them():
    assert linked("[a](a/) [b](b/x.json) [web](https://x.org/y) [c](c.json#part) `[d](e)`") == {
        "a/", "b/x.json", "c.json", "e"}
