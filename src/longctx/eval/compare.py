"""Two runs of the pipeline paired on their prompts: a sweep's experiments, or any two git revisions
or DVC experiments of one workspace. The eval builds prompt i of a task and length from its own
seed, so two runs with the same eval seed and lengths ask the same prompts (a run with more
`eval.samples` asks those and more): each checkpoint of one run is compared with the same
checkpoint of the other on the prompts both asked (sign test, 95%).

    python -m longctx.eval.compare exp-1a2b3 HEAD      # experiment vs the committed run
    python -m longctx.eval.compare a/reports/eval/prompts.jsonl b/reports/eval/prompts.jsonl   # two workspaces
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ..errors import DataError
from . import report

PROMPTS = "reports/eval/prompts.jsonl"
"""Every scored prompt of a run, in the eval's order (a DVC output of the eval stage)."""


def prompt_rows(workspace: Path, rev: str | None = None) -> list[dict]:
    """The scored prompts of the run at git revision or DVC experiment `rev` (None: the workspace
    as it is), read through DVC's cache; `rev` naming a prompts file (a `.jsonl` that exists) is
    read as it is: runs in workspaces of their own, without git or DVC (scripts/gpu/recipe.sh)."""
    if rev is not None and rev.endswith(".jsonl") and Path(rev).is_file():
        return rows(Path(rev).read_text(), rev)
    import dvc.api

    try:
        text = dvc.api.read(PROMPTS, repo=str(workspace), rev=resolve(workspace, rev) if rev else None)
    except Exception as e:  # DVC raises its own errors for a missing revision, output or cache entry
        raise DataError(f"{workspace / PROMPTS} at {rev or 'the workspace'}: cannot read the run's scored "
                        f"prompts ({type(e).__name__}: {e}); was the eval stage run there?") from e
    return rows(text, f"{workspace / PROMPTS} at {rev or 'the workspace'}")


def rows(text: str, where: str) -> list[dict]:
    """Prompt rows, one JSON object a line, each with its checkpoint, task, length and score."""
    try:
        out = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not the eval's scored prompts (line {e.lineno}: {e.msg})") from e
    if not out or not all(isinstance(r, dict) and {"checkpoint", "task", "length", "score"} <= r.keys() for r in out):
        raise DataError(f"{where}: not the eval's scored prompts (each line needs checkpoint, task, length, score)")
    return out


def resolve(workspace: Path, rev: str) -> str:
    """A git revision, or a DVC experiment's name (`dvc exp show`'s), as a commit."""
    out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=workspace,
                         capture_output=True, text=True)
    if out.returncode == 0:
        return out.stdout.strip()
    refs = subprocess.run(["git", "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps"],
                          cwd=workspace, capture_output=True, text=True).stdout.split("\n")
    found = [sha for sha, _, ref in (line.partition(" ") for line in refs if line) if ref.rsplit("/", 1)[-1] == rev]
    if len(found) != 1:
        raise DataError(f"{rev}: {'no' if not found else 'more than one'} git revision or DVC experiment of that "
                        f"name in {workspace} (`dvc exp show` lists them)")
    return found[0]


def paired_runs(new: list[dict], old: list[dict]) -> dict:
    """Checkpoint -> `new` against `old` per task and length and over every prompt of a length
    ("all"), on the prompts both runs asked; checkpoints in one run only are left out."""
    ckpts = [c for c in dict.fromkeys(r["checkpoint"] for r in new) if any(r["checkpoint"] == c for r in old)]
    return {c: report.paired_rows([r for r in new if r["checkpoint"] == c], [r for r in old if r["checkpoint"] == c])
            for c in ckpts}


def table(verdicts: dict, new: str, old: str) -> str:
    """Markdown: each checkpoint's verdict against the other run at every length (every prompt
    of the length paired)."""
    lengths = sorted({int(n) for by in verdicts.values() for n in by["all"]})
    lines = [f"{new} against {old}, the same prompts (sign test, 95%): verdict (prompts won-lost)", "",
             "| checkpoint | " + " | ".join(f"@{n}" for n in lengths) + " |", "|" + "---|" * (len(lengths) + 1)]
    for c, by in verdicts.items():
        lines.append(f"| {c} | " + " | ".join(report.verdict_text(by["all"][n]) if n in by["all"] else "-"
                                              for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Pair two runs' eval on the same prompts: better, worse or "
                                                 "no difference at 95% per checkpoint and length.")
    parser.add_argument("new", help="git revision, DVC experiment name or a run's reports/eval/prompts.jsonl")
    parser.add_argument("old", help="the same, to compare against")
    parser.add_argument("--workspace", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    try:
        verdicts = paired_runs(prompt_rows(args.workspace, args.new), prompt_rows(args.workspace, args.old))
    except DataError as e:
        print(f"longctx compare: {e}", file=sys.stderr)
        sys.exit(2)
    if not verdicts:
        print(f"longctx compare: {args.new} and {args.old} share no checkpoint", file=sys.stderr)
        sys.exit(2)
    print(table(verdicts, args.new, args.old), end="")


if __name__ == "__main__":
    main()
