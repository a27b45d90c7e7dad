"""Real text that every Python install carries, shaped like ProLong's domains.

The `tiny` profile must run offline on any machine, so its corpus is the standard library:
packages as repository-level code documents (ProLong's construction: all files of a repo
concatenated, in random order, each under a path header), docstrings and the language
reference as long prose, single modules and docstrings as short data, and docstring
question/answer conversations as SFT data. Nothing here is generated filler.
"""

from __future__ import annotations

import ast
import functools
import inspect
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = {".py", ".pyi", ".txt", ".rst", ".md", ".cfg", ".toml", ".ini", ".json", ".c", ".h"}
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test", "_bundled"}
MAX_FILE_BYTES = 1 << 20
TOPIC_VOLUME_CHARS = 64_000


@dataclass(frozen=True)
class Docstring:
    qualname: str
    docstring: str
    signature: str | None


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _packages(root: Path) -> list[Path]:
    return sorted(
        p for p in root.iterdir() if p.is_dir() and p.name not in SKIP_DIRS and (p / "__init__.py").is_file()
    )


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*.py") if p.is_file())


def _text_files(package: Path) -> list[Path]:
    files = []
    for p in sorted(package.rglob("*")):
        rel = p.relative_to(package)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if p.is_file() and p.suffix in TEXT_SUFFIXES and p.stat().st_size <= MAX_FILE_BYTES:
            files.append(p)
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def repos(seed: int, site_packages: bool = False) -> Iterator[tuple[str, str]]:
    """(id, text): each package concatenated, files shuffled, each under its path header."""
    roots = [stdlib_dir()]
    if site_packages:
        roots.append(Path(sysconfig.get_paths()["purelib"]))
    packages = [p for root in roots for p in _packages(root)]
    random.Random(f"{seed}:repos").shuffle(packages)
    for pkg in packages:
        files = _text_files(pkg)
        random.Random(f"{seed}:{pkg.name}").shuffle(files)
        parts = []
        for f in files:
            text = _read(f)
            if text:
                parts.append(f"### File: {pkg.name}/{f.relative_to(pkg).as_posix()}\n{text}\n")
        if parts:
            yield f"stdlib_repos:{pkg.name}", "".join(parts)


@functools.cache
def docstrings(path: Path, module: str) -> tuple[Docstring, ...]:
    """Module, class and function docstrings of one source file, in file order (parsed once:
    books, short data and SFT all read them)."""
    text = _read(path)
    if text is None:
        return ()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    out: list[Docstring] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                sig = None
                if not isinstance(child, ast.ClassDef):
                    sig = f"{child.name}({ast.unparse(child.args)})"
                if doc and not child.name.startswith("_"):
                    out.append(Docstring(name, inspect.cleandoc(doc), sig))
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    doc = ast.get_docstring(tree)
    if doc:
        out.append(Docstring(module, inspect.cleandoc(doc), None))
    visit(tree, module)
    return tuple(out)


def _sources() -> Iterator[tuple[str, list[tuple[Path, str]]]]:
    """(unit name, [(file, dotted module)]): each stdlib package, then each top-level module."""
    root = stdlib_dir()
    for pkg in _packages(root):
        files = [
            (f, ".".join((pkg.name, *f.relative_to(pkg).with_suffix("").parts)).removesuffix(".__init__"))
            for f in _text_files(pkg)
            if f.suffix == ".py"
        ]
        yield pkg.name, files
    for mod in _modules(root):
        yield mod.stem, [(mod, mod.stem)]


def docstring_books() -> Iterator[tuple[str, str]]:
    """(id, text): the docstrings of each package or module, as one manual."""
    for unit, files in _sources():
        entries = [d for f, m in files for d in docstrings(f, m)]
        if entries:
            body = "\n\n".join(f"{d.qualname}\n{'=' * len(d.qualname)}\n\n{d.docstring}" for d in entries)
            yield f"stdlib_books:{unit}", f"The {unit} manual\n\n{body}\n"


def topic_volumes() -> Iterator[tuple[str, str]]:
    """(id, text): the language reference's topics (pydoc_data), bound into volumes."""
    from pydoc_data.topics import topics

    volume: list[str] = []
    size = 0
    n = 0
    keys = sorted(topics)
    for i, key in enumerate(keys):
        volume.append(f"{key}\n{'-' * len(key)}\n\n{topics[key].strip()}\n")
        size += len(volume[-1])
        if size >= TOPIC_VOLUME_CHARS or i == len(keys) - 1:
            n += 1
            yield f"stdlib_topics:volume{n}", f"Python Language Reference, volume {n}\n\n" + "\n".join(volume)
            volume, size = [], 0


def short_docstrings() -> Iterator[tuple[str, str]]:
    for _, files in _sources():
        for f, m in files:
            for d in docstrings(f, m):
                if len(d.docstring) >= 80:
                    yield f"stdlib_docstring:{d.qualname}", f"{d.qualname}\n\n{d.docstring}\n"


def short_modules() -> Iterator[tuple[str, str]]:
    for mod in _modules(stdlib_dir()):
        text = _read(mod)
        if text:
            yield f"stdlib_module:{mod.stem}", text


QUESTIONS = (
    "What does `{name}` do?",
    "Explain `{qualname}` to me.",
    "How do I use `{name}` from the `{module}` module?",
    "I came across `{qualname}` in some code. What is it for?",
)
SYSTEM = "You are a helpful assistant who knows the Python standard library well."


def conversations(seed: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(id, messages): a question about a documented function or class, answered by its
    docstring; with a follow-up about the signature when it has one."""
    rng = random.Random(f"{seed}:sft")
    for _, files in _sources():
        for f, m in files:
            for d in docstrings(f, m):
                if len(d.docstring) < 40 or d.qualname == m:
                    continue
                name = d.qualname.rsplit(".", 1)[-1]
                q = rng.choice(QUESTIONS).format(name=name, qualname=d.qualname, module=m)
                messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.25 else []
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": d.docstring}]
                if d.signature:
                    messages += [
                        {"role": "user", "content": "What is its signature?"},
                        {"role": "assistant", "content": f"`{d.qualname.rsplit('.', 1)[0]}.{d.signature}`"},
                    ]
                yield f"stdlib_sft:{d.qualname}", messages
