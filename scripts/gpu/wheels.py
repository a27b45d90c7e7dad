"""The wheel folder a GPU machine without internet needs to run the pipeline (issue 32): the
project's requirements closed over their own, at the versions this machine's install resolved,
less what the GPU image already has, as wheels for the image's Python, within the device's carry
limit. scripts/gpu/env.sh installs the folder on the GPU machine.

    python3 scripts/gpu/wheels.py --freeze > scripts/gpu/image.txt     # on the GPU machine: what it has
    python scripts/gpu/wheels.py --image scripts/gpu/image.txt --out .whl   # here, with internet

With --imports, only the distributions a real run imported from (record one with
scripts/gpu/import_audit: `PYTHONPATH=scripts/gpu/import_audit LONGCTX_IMPORT_LOG=imports.txt python -m pipelines`).
Packages that ship no wheel are built here (`pip wheel`, pure Python). --without drops a top-level
requirement the run does not import (lm-eval, with every package only it needs) when the folder
would not fit otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
"""The GPU image's interpreter and platform (KINDS.md: Python 3.12 on x86-64 Linux), for markers."""
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
CARRY = 64 << 20
"""Bytes the device carries: the working tree (tracked and untracked files git does not ignore) and
the wheels together."""
SLIM = {"mlflow": ("mlflow/server/js/",)}
"""Parts of a wheel no GPU run uses, left out of its copy: the MLflow UI's built JavaScript (7.3 MiB
of mlflow's 11.5; a GPU machine is never browsed: its runs' stores come back and open here)."""


def _applies(req: Requirement, extras: tuple[str, ...]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET, "extra": e}) for e in ("", *extras))


def closure(root: str = "longctx", without: tuple[str, ...] = ()) -> dict[str, str]:
    """{canonical name: installed version} of `root` and everything it requires on the target, as
    installed here; `without` names top-level requirements left out (with what only they need)."""
    drop = {canonicalize_name(n) for n in without}
    found: dict[str, str] = {}
    walked: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(root, ())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in walked:
            continue
        walked.add((key, extras))
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise SystemExit(f"{name} is required but not installed here: install the project first "
                             "(pip install -e .)") from None
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if _applies(req, extras) and not (name == root and canonicalize_name(req.name) in drop):
                todo.append((req.name, tuple(sorted(req.extras))))
    found.pop(canonicalize_name(root))
    return found


def read_freeze(path: Path) -> dict[str, str]:
    """`pip list --format=freeze` lines (name==version) as {canonical name: version}."""
    have = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "==" not in line:
            raise SystemExit(f"{path}:{n}: not a name==version line: {line!r}")
        name, version = line.split("==", 1)
        have[canonicalize_name(name)] = version
    return have


def lacking(needed: dict[str, str], have: dict[str, str]) -> dict[str, str]:
    """What the image lacks: any version there serves (its torch, numpy and CUDA builds are its own)."""
    return {name: version for name, version in sorted(needed.items()) if name not in have}


def imported(wanted: dict[str, str], log: Path) -> dict[str, str]:
    """Of `wanted`, the distributions a real run imported from: `log` lists top-level module names
    (scripts/gpu/import_audit/sitecustomize.py records them in every process of a run). A requirement's
    optional backends (a Postgres driver, Redis, cloud SDKs) are declared but never imported."""
    modules = set(log.read_text().split())
    if not modules:
        raise SystemExit(f"{log}: no module names in it: run the pipeline with scripts/gpu/import_audit first")
    owners = md.packages_distributions()  # (a scan of every installed distribution: once)
    used = {canonicalize_name(d) for m in modules for d in owners.get(m, [])}
    return {name: version for name, version in wanted.items() if name in used}


def fetch(wanted: dict[str, str], out: Path) -> list[Path]:
    """Download each as a wheel for the target into `out` (built here when it ships none)."""
    out.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in wanted.items():
        pin = f"{name}=={version}"
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                              "--python-version", TARGET["python_version"], "--implementation", "cp", *platforms,
                              "-d", str(out), pin], capture_output=True, text=True)
        if got.returncode:
            built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), pin],
                                   capture_output=True, text=True)
            if built.returncode:
                raise SystemExit(f"{pin}: no wheel for Python {TARGET['python_version']} on x86-64 Linux, and "
                                 f"building one failed:\n{got.stderr[-800:]}\n{built.stderr[-800:]}")
    for wheel in out.glob("*.whl"):
        drop = SLIM.get(canonicalize_name(wheel.name.split("-")[0]))
        if drop:
            slim(wheel, drop)
    return sorted(out.glob("*.whl"))


def slim(wheel: Path, drop: tuple[str, ...]) -> None:
    """Rewrite `wheel` in place without the files under the `drop` prefixes (and their RECORD lines,
    so that what it lists is what it holds)."""
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename.startswith(drop):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line + b"\n" for line in data.splitlines() if not line.decode().startswith(drop))
            zout.writestr(info, data)
    tmp.replace(wheel)


def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree a device call sends (tracked and untracked-not-ignored files)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                           text=True, check=True).stdout.split("\0")
    return sum((repo / n).stat().st_size for n in names if n and (repo / n).is_file())


def check_size(wheels: list[Path], budget: int) -> int:
    total = sum(w.stat().st_size for w in wheels)
    if total > budget:
        largest = sorted(wheels, key=lambda w: -w.stat().st_size)[:8]
        raise SystemExit(f"the wheels take {total / 2**20:.1f} MiB, over the {budget / 2**20:.0f} MiB the device "
                         "carries beside the tree; the largest: "
                         + ", ".join(f"{w.name} ({w.stat().st_size / 2**20:.1f} MiB)" for w in largest)
                         + " (--without drops a requirement the run does not import)")
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--freeze", action="store_true", help="print this machine's packages (run it on the GPU)")
    ap.add_argument("--image", type=Path, help="the GPU image's packages, as --freeze printed them there")
    ap.add_argument("--out", type=Path, default=Path(".whl"))
    ap.add_argument("--without", nargs="*", default=[], help="top-level requirements to leave out")
    ap.add_argument("--imports", type=Path, help="top-level modules a run imported (scripts/gpu/import_audit): "
                    "only the distributions they come from")
    ap.add_argument("--budget-mib", type=float, help="MiB the wheels may take (default: 64 less the working tree)")
    args = ap.parse_args()
    if args.freeze:
        for dist in sorted(md.distributions(), key=lambda d: canonicalize_name(d.metadata["Name"])):
            print(f"{canonicalize_name(dist.metadata['Name'])}=={dist.version}")
        return
    if args.image is None:
        ap.error("--image: the GPU image's package list (scripts/gpu/wheels.py --freeze, run there)")
    wanted = lacking(closure(without=tuple(args.without)), read_freeze(args.image))
    if args.imports:
        kept = imported(wanted, args.imports)
        print(f"not imported by the run in {args.imports}, left out: {', '.join(sorted(set(wanted) - set(kept)))}")
        wanted = kept
    print(f"{len(wanted)} packages the image lacks: " + ", ".join(f"{n}=={v}" for n, v in wanted.items()), flush=True)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: move it away first (two versions of one package stop the "
                         "install there)")
    partial = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        budget = CARRY - tree_bytes(Path.cwd()) if args.budget_mib is None else int(args.budget_mib * 2**20)
        total = check_size(fetch(wanted, partial), budget)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-made is left where the next call looks
        raise
    if args.out.exists():
        args.out.rmdir()
    partial.rename(args.out)
    print(f"{args.out}: {len(list(args.out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
