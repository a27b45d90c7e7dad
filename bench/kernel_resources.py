"""Registers, spills and shared memory of the FoX kernels for one GPU architecture, per
autotuning configuration, compiled on this machine: Triton lowers each kernel to PTX and ptxas
(shipped with Triton) reports, so no GPU is needed. Spilled registers go to local memory in the
inner loop, which costs time; shared memory past the chip's limit makes a configuration fail to
launch (the autotuner then skips it). Timing still needs bench/attention.py on the GPU.

    python bench/kernel_resources.py       # sm_90: H100 / H200
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU even where tests interpret kernels

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longctx.model.fox import kernel as fk  # noqa: E402
from longctx.perf import write_result  # noqa: E402

# the most dynamic shared memory one block may use, per compute capability (CUDA guide, table 21)
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}

# argument types by name: 16-bit activations, fp32 decay / statistics, int32 bounds
POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "OUT": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16",
            "DV": "*bf16", "LAM": "*fp32", "ROW": "*fp32", "DELTA": "*fp32", "LSE": "*fp32", "DLAM": "*fp32",
            "DCOL": "*fp32", "START": "*i32", "END": "*i32", "KSTART": "*i32", "QEND": "*i32", "scale": "fp32",
            "sm_scale": "fp32", "LOGF": "*fp32", "DLOGF": "*fp32", "CU": "*i32", "TILES": "*i32"}
KERNELS = {"fwd": (fk._fwd_kernel, fk.FWD_OPTIONS), "dq": (fk._dq_kernel, fk.DQ_OPTIONS),
           "dkdv": (fk._dkdv_kernel, fk.DKDV_OPTIONS), "bounds": (fk._bounds_kernel, [(0, 0, 1, 1)]),
           "prepare": (fk._prepare_kernel, [(0, 0, 4, 1)]), "dlogf": (fk._dlogf_kernel, [(0, 0, 4, 1)]),
           "bwd_prep": (fk._bwd_prep_kernel, [(0, 0, 4, 1)])}
SMALL = {"bounds": {"ACP": True, "T": fk.TILE}, "prepare": {"DECAY": True, "BLOCK": fk.SCAN_BLOCK, "T": fk.TILE},
         "dlogf": {"BLOCK": fk.SCAN_BLOCK}, "bwd_prep": {"BLOCK": 64}}
"""The small kernels around the three attention kernels: no tiles to tune, one shape each."""


def compile_kernel(fn, constants: dict, warps: int, stages: int, arch: int):
    """Compile `fn` for compute capability `arch` with the given constexpr values."""
    missing = {fn.arg_names[i] for i in fn.constexprs} - set(constants)
    if missing:
        raise ValueError(f"{fn.__name__}: no value for constexpr {sorted(missing)}")
    signature = {name: "constexpr" if i in fn.constexprs else POINTERS.get(name, "i32")
                 for i, name in enumerate(fn.arg_names)}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps,
                                                                             "num_stages": stages})


def ptxas_report(ptx: str, arch: int) -> dict:
    """Registers per thread and spill bytes, as the ptxas Triton compiles with reports them."""
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", "-lineinfo", f"--gpu-name=sm_{arch}{suffix}", str(src),
                               "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas failed on sm_{arch}: {done.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas report: {done.stderr[-2000:]}")
    return {"registers": int(regs[1]), "spill_stores": int(spills[1]), "spill_loads": int(spills[2])}


def measure(kernel: str, d: int, groups: int, option: tuple[int, int, int, int], arch: int,
            wide: bool = False) -> dict:
    """ptxas's registers and spills and the shared memory of one kernel option; `wide`: the 64-bit
    offsets variant (q beyond 2**31 elements)."""
    fn, _ = KERNELS[kernel]
    bm, bn, warps, stages = option
    if kernel == "bwd_prep":
        constants = SMALL[kernel] | {"D": d, "WIDE": wide}
    elif kernel in SMALL:
        constants = SMALL[kernel]
    else:
        constants = {"GROUPS": groups, "D": d, "BM": bm, "BN": bn, "T": fk.TILE, "PREC": "tf32", "WIDE": wide}
    compiled = compile_kernel(fn, constants, warps, stages, arch)
    row = {"kernel": kernel, "wide": wide, "D": d, "groups": groups, "BM": bm, "BN": bn, "warps": warps,
           "stages": stages, **ptxas_report(compiled.asm["ptx"], arch), "shared_bytes": compiled.metadata.shared}
    row["fits"] = row["shared_bytes"] <= SHARED_LIMIT[arch]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="compute capability x 10")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="(padded) head dims")
    ap.add_argument("--groups", type=int, nargs="+", default=[1], help="query heads per KV head")
    ap.add_argument("--first", action="store_true", help="only each kernel's first (untuned default) option")
    ap.add_argument("--wide", action="store_true", help="the 64-bit offsets variants (sequences past 2**31 "
                    "elements of q) rather than the 32-bit ones")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kernel-resources"),
                   help="folder of the JSON (<benchmark>-<device>-<date>.json)")
    args = ap.parse_args()
    for d in args.dims:
        if d < 16 or d & (d - 1):
            ap.error(f"--dims: {d} is not a power of two >= 16 (the kernels pad head dims to one)")

    rows = []
    print(f"{'kernel':<8} {'D':>4} {'grp':>3} {'BM':>4} {'BN':>4} {'warps':>5} {'stages':>6} {'regs':>5} "
          f"{'spill st':>8} {'spill ld':>8} {'smem KiB':>8}")
    for kernel in args.kernels:
        options = KERNELS[kernel][1][:1] if args.first else KERNELS[kernel][1]
        shapes = [(d, 1) for d in args.dims] if kernel == "bwd_prep" else [(0, 1)] if kernel in SMALL \
            else [(d, g) for d in args.dims for g in args.groups]
        for d, groups in shapes:
            for option in options:
                r = measure(kernel, d, groups, option, args.arch, args.wide)
                rows.append(r)
                print(f"{kernel:<8} {d:>4} {groups:>3} {r['BM']:>4} {r['BN']:>4} {r['warps']:>5} {r['stages']:>6} "
                      f"{r['registers']:>5} {r['spill_stores']:>8} {r['spill_loads']:>8} "
                      f"{r['shared_bytes'] / 1024:>8.1f}{'' if r['fits'] else '  too much shared memory'}",
                      flush=True)
    write_result(args.out, "kernel_resources" + ("-wide" if args.wide else ""),
                 {"arch": args.arch, "triton": triton.__version__, "wide": args.wide, "rows": rows},
                 device=f"sm{args.arch}")


if __name__ == "__main__":
    main()
