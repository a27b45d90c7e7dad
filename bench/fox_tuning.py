"""What the FoX kernels' autotuning costs a process, and whether Triton's disk cache pays it once
(issue 62: the FoX pipeline's eval tuned again for every new length key, up to 15 s each). Two
processes in turn share one fresh Triton cache: `cold` tunes every length class (the kernels'
SIZE key, kernel.size_class: one for every length from 32K up, below it one per power of two of the
packed tokens; --largest-class 0: one per power of two throughout), `warm` should read every choice
back. Each
length: its first call (compile, tune, run) and a second, the gap being what tuning and
compilation cost; forward alone at the eval's packed batches, forward and backward at the
training stages' (gpu-64k: 8 x 4K = 32K, 4 x 16K and 1 x 64K = 64K). The configuration the tuner
chose for each class is recorded: where one choice holds across classes, a coarser key would tune
fewer times.

    python bench/fox_tuning.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORWARD = [4096, 16384, 32768, 65536, 131072, 262144, 524288, 1048576]
BACKWARD = [32768, 65536]


def measure(forward: list[int], backward: list[int], heads: int, kv_heads: int, dim: int, doc: int) -> list[dict]:
    """Per length (forward-only ones first): the first and second call's seconds and the
    configurations the tuner chose on the first."""
    import torch
    import torch.nn.functional as F

    from longctx.model.fox import kernel as fk

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tuners = {"fwd": fk._fwd, "dq": fk._dq, "dkdv": fk._dkdv}
    rows = []
    for n, grad in [(n, False) for n in forward] + [(n, True) for n in backward]:
        gen = torch.Generator(device=dev).manual_seed(n)
        q, k, v = (torch.randn(n, h, dim, device=dev, generator=gen, dtype=torch.bfloat16).requires_grad_(grad)
                   for h in (heads, kv_heads, kv_heads))
        log_f = F.logsigmoid(torch.randn(n, heads, device=dev, generator=gen) + 4).requires_grad_(grad)
        cu = torch.tensor([*range(0, n, min(doc, n)), n], dtype=torch.int32, device=dev)
        seen = {name: set(t.cache) for name, t in tuners.items()}
        seconds = []
        for _ in range(2):
            begin = time.perf_counter()
            with torch.set_grad_enabled(grad):
                out, _ = fk.attend(q, k, v, cu, log_f)
                if grad:
                    out.float().square().mean().backward()
            if dev == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - begin)
        chosen = {name: str(t.cache[key]) for name, t in tuners.items() for key in set(t.cache) - seen[name]}
        rows.append({"tokens": n, "backward": grad, "size_class": fk.size_class(n), "first_s": round(seconds[0], 3),
                     "second_s": round(seconds[1], 4), "tuning_s": round(seconds[0] - seconds[1], 3),
                     "chosen": chosen})
    return rows


def table(runs: dict[str, list[dict]]) -> str:
    lines = [f"{'run':<6} {'tokens':>9} {'pass':<8} {'class':>5} {'first s':>8} {'second s':>9} {'tuning s':>9}"]
    for name, rows in runs.items():
        for r in rows:
            lines.append(f"{name:<6} {r['tokens']:>9} {'fwd+bwd' if r['backward'] else 'fwd':<8} {r['size_class']:>5} "
                         f"{r['first_s']:>8.2f} {r['second_s']:>9.3f} {r['tuning_s']:>9.2f}")
        lines.append(f"{name:<6} total tuning and compilation: {sum(r['tuning_s'] for r in rows):.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forward", type=int, nargs="*", default=FORWARD, help="packed tokens timed forward alone")
    ap.add_argument("--backward", type=int, nargs="*", default=BACKWARD, help="packed tokens timed with backward")
    ap.add_argument("--heads", type=int, default=12, help="gpu-64k's FoX: 12 heads of 64 dims, no GQA")
    ap.add_argument("--kv-heads", type=int, default=12)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--doc", type=int, default=65536, help="document length inside the packed tokens")
    ap.add_argument("--largest-class", type=int, help="LONGCTX_FOX_LARGEST_CLASS for both processes (0: a class a "
                    "power of two; unset: the kernel's default, 16: one class from 32K up)")
    ap.add_argument("--runs", nargs="*", default=["cold", "warm"], help="processes in turn on one fresh cache")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # (one process's rows go to this file)
    ap.add_argument("--out", type=Path, default=Path("bench/results/fox-tuning"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    a = ap.parse_args(argv)
    shape = dict(heads=a.heads, kv_heads=a.kv_heads, dim=a.dim, doc=a.doc)
    if a.child:
        a.child.write_text(json.dumps(measure(a.forward, a.backward, **shape)))
        return {}
    runs = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "LONGCTX_FOX_TUNING_CACHE": "1"}
        if a.largest_class is not None:
            env["LONGCTX_FOX_LARGEST_CLASS"] = str(a.largest_class)
        for name in a.runs:
            rows = Path(cache) / f"{name}.json"
            cmd = [sys.executable, __file__, "--child", str(rows), "--forward", *map(str, a.forward),
                   "--backward", *map(str, a.backward), *(f"--{k.replace('_', '-')}={v}" for k, v in shape.items())]
            begin = time.perf_counter()
            subprocess.run(cmd, env=env, check=True)
            runs[name] = json.loads(rows.read_text())
            print(f"{name}: {time.perf_counter() - begin:.1f} s the process", flush=True)
    print(table(runs))
    classes = {r["size_class"]: r["chosen"] for r in runs[a.runs[0]] if r["chosen"]}
    result = {"shape": shape, "largest_class": a.largest_class, "runs": runs, "chosen_by_class": classes,
              "tuning_s": {name: round(sum(r["tuning_s"] for r in rows), 2) for name, rows in runs.items()}}
    import torch

    from longctx.perf import write_result

    write_result(a.out, "fox_tuning", result, device=None if torch.cuda.is_available() else "cpu")
    return result


if __name__ == "__main__":
    main()
