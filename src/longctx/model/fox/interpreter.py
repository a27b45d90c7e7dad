"""Triton's interpreter (TRITON_INTERPRET=1: the FoX kernel on a CPU) made cheaper where its
own overheads, not the kernel's arithmetic, take most of a CPU run's time.

Scans: the interpreter runs `tl.associative_scan` with a custom combine function one element at a time
in Python, so the kernel's segmented sums (the per-document cumulative log forget gates and
their gradient) cost a Python call per token and head: most of a CPU run of FoX. Here the scan
runs as Hillis-Steele doubling, log2(n) calls of the same combine function on whole shifted
blocks. The combine is associative (what associative_scan requires), so the result is the scan's;
float sums may round in another order, as they do on a GPU, whose scan is a tree too.

Device functions: every call of a @triton.jit helper inside a kernel re-patches triton.language
with the interpreter's builtins (walking its modules with inspect.getmembers), though the
kernel's launch has patched them already and restores them when it ends. Here only a launch
patches; the helpers' calls while it runs find the language patched.

Both are installed only where Triton has the interpreter internals they replace (3.6 to 3.9);
elsewhere the interpreter runs as it comes, slower and the same.
"""

from __future__ import annotations

import numpy as np


def _doubling_scan(self, inputs):
    """ScanOps.generic_scan's contract (inputs: tl tensors; returns one tl tensor per input).
    Each doubling combines every element with the one `step` before it (blocks keep their
    power-of-two shape: the first `step` elements, which have none, keep their values)."""
    axis = self.axis
    data = [np.array(t.handle.data) for t in inputs]
    n = data[0].shape[axis]
    index = np.arange(n).reshape([-1 if d == axis else 1 for d in range(data[0].ndim)])
    step = 1
    while step < n:
        before = [self.to_tensor(np.roll(x, step, axis=axis), t.dtype) for x, t in zip(data, inputs, strict=True)]
        here = [self.to_tensor(x, t.dtype) for x, t in zip(data, inputs, strict=True)]
        out = self.combine_fn.fn(*before, *here)
        out = out if isinstance(out, tuple) else (out,)
        data = [np.where(index >= step, np.broadcast_to(o.handle.data if hasattr(o, "handle") else o, x.shape), x)
                for x, o in zip(data, out, strict=True)]
        step *= 2
    return [self.to_tensor(x, t.dtype) for x, t in zip(data, inputs, strict=True)]


class _Patched:
    """The scope a helper's call gets when the running launch has patched its language."""

    @staticmethod
    def restore() -> None:
        pass


def _patch_per_launch(patch_lang):
    """patch_lang as the interpreter calls it: from a launch (which restores the scope when it
    ends), then from every helper call inside it (which drops the scope). A helper whose
    language modules (triton.language, triton.language.core) the launch has patched skips it."""
    import triton.language as tl

    running: list[set[int]] = []  # the running launch's patched modules

    def patch(fn):
        mods = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if running and mods <= running[0]:
            return _Patched
        scope = patch_lang(fn)
        if running:  # a helper of another module (triton.language's own): kept patched, as before
            running[0] |= mods
            return scope
        restore = scope.restore

        def restore_and_end():
            running.clear()
            restore()

        scope.restore = restore_and_end
        running.append(mods)
        return scope

    patch.per_launch = True
    return patch


def speed_up() -> None:
    """Install both in Triton's interpreter (idempotent)."""
    from triton.runtime import interpreter

    if hasattr(getattr(interpreter, "ScanOps", None), "generic_scan"):
        interpreter.ScanOps.generic_scan = _doubling_scan
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is not None and not getattr(patch_lang, "per_launch", False):
        interpreter._patch_lang = _patch_per_launch(patch_lang)
