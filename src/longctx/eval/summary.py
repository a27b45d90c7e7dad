"""The pipeline's closing table, read from metrics/eval.json: what the main command prints and
the MLflow parent run's description."""

from __future__ import annotations

import json
from pathlib import Path

from .report import BEYOND, GROUPS, beyond, length_means, position_bands


def summary(ws: Path) -> str:
    """One column per checkpoint: its score on every task at every evaluated length (a block per
    length, with the mean over tasks), each with its 95% interval, the paired verdict against
    the base, its perplexities and loss by position, and a line naming the best checkpoint at the longest length
    only where the paired test supports it."""
    ev = json.loads((ws / "metrics" / "eval.json").read_text())
    lengths, means = length_means(ev["tasks"])
    windows = ev.get("windows", {})  # (absent from results of older runs)
    ckpts = list(ev["tasks"])
    groups = ev.get("formats", {})  # (absent from results of older runs)
    held = set(groups.get("tasks", {}).get("held_out", []))
    tasks = sorted({t for by_task in ev["tasks"].values() for t in by_task}, key=lambda t: (t in held, t))

    cells = ev.get("cells", {})  # (absent from results of older runs)
    spread = ev.get("means", {})

    def score(ckpt: str, value: float | None, n: int, task: str | None = None, cell: dict | None = None) -> str:
        if value is None:
            return "-"
        cell = cell or (cells.get(ckpt, {}).get(task, {}) if task else spread.get(ckpt, {})).get(str(n))
        text = f"{value:.2f} [{cell['lo']:.2f}-{cell['hi']:.2f}]" if cell else f"{value:.2f}"
        return text + (BEYOND if beyond(windows, ckpt, n) else "")

    def group_score(g: str, ckpt: str, n: int) -> str:
        cell = groups["means"][g].get(ckpt, {}).get(str(n))
        return score(ckpt, cell and cell["mean"], n, cell=cell)

    def counts(n: int) -> str:
        seen = sorted({cell[str(n)]["n"] for by in cells.values() for cell in by.values() if str(n) in cell})
        return f" (n = {'/'.join(map(str, seen))} prompts a task; 95% intervals)" if seen else ""

    rows = [["", *ckpts]]
    for n in lengths:
        rows.append([f"at {n} tokens{counts(n)}"])
        rows += [[f"  {t}{' (held-out)' if t in held else ''}", *(score(c, ev["tasks"][c].get(t, {}).get(str(n)), n, t)
                                                                for c in ckpts)] for t in tasks]
        if held:
            rows += [[f"  mean, {label}", *(group_score(g, c, n) for c in ckpts)] for g, label in GROUPS.items()]
        rows.append(["  mean" + (", all tasks" if held else ""), *(score(c, means[c].get(n), n) for c in ckpts)])
        verdicts = ev.get("verdicts", {})
        if verdicts:
            rows.append(["  vs base", *(verdict(verdicts[c]["base"]["all"].get(str(n))) if c in verdicts else ""
                                        for c in ckpts)])

    def ppl(table: dict, ckpt: str) -> str:
        by = table.get(ckpt, {})
        top = max(ev["ppl_by_length"].get(ckpt, {}), key=int, default=None)
        return f"{by[top]:.1f}" if top in by else "n/a"

    tops = {max(by, key=int) for by in ev["ppl_by_length"].values() if by}
    at = f"{tops.pop()} tokens" if len(tops) == 1 else "the longest length"
    rows += [["perplexity"], [f"  at {at}", *(ppl(ev["ppl_by_length"], c) for c in ckpts)],
             [f"  needle at {at}", *(ppl(ev["needle_ppl"], c) for c in ckpts)],
             ["  short context", *(f"{ev['retention_ppl'][c]:.1f}" if c in ev["retention_ppl"] else "n/a"
                                   for c in ckpts)]]
    by_position = ev.get("position_loss", {})
    bands = position_bands(by_position)
    docs = sorted({by["documents"] for by in by_position.values() if "documents" in by})
    if bands:
        rows.append([f"loss by position (mean over {'/'.join(map(str, docs))} long documents)"])
        rows += [[f"  tokens {b}", *(f"{by_position[c]['bands'][b]:.3f}"
                                     if b in by_position.get(c, {}).get("bands", {}) else "n/a"
                                     for c in ckpts)] for b in bands]
    width = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(ckpts) + 1)]
    table = "\n".join("  ".join([r[0].ljust(width[0]), *(c.rjust(w) for c, w in zip(r[1:], width[1:], strict=False))])
                       .rstrip() for r in rows)  # (a block's heading row has one cell)
    if any(beyond(windows, c, n) for c in ev["tasks"] for n in lengths):
        table += f"\n{BEYOND} beyond the checkpoint's window (the length it was trained to)"
    longest = lengths[-1] if lengths else None
    top = ev.get("best", {}).get(str(longest))
    if top is None:
        return table
    if all(v["wins"] == v["losses"] == 0 for v in top["against"].values()):
        return table + (f"\nat {longest} tokens every checkpoint scores {top['mean']:.2f}, alike on every prompt: "
                        "the tasks do not tell them apart")
    if top["supported"]:
        return table + (f"\nbest at {longest} tokens: {top['checkpoint']} (mean task score {top['mean']:.2f}; "
                        "better than every other checkpoint on the same prompts at 95%)")
    ties = [c for c, v in top["against"].items() if v["verdict"] != "better"]
    return table + (f"\nat {longest} tokens no checkpoint is best at 95%: {top['checkpoint']} scores highest "
                    f"({top['mean']:.2f}) but is not better than {', '.join(ties)} on the same "
                    "prompts")


def verdict(v: dict | None) -> str:
    """A paired verdict in a table cell: `better 12-3` (prompts won and lost)."""
    if v is None:
        return "-"
    return f"{'no diff.' if v['verdict'] == 'no difference' else v['verdict']} {v['wins']}-{v['losses']}"
