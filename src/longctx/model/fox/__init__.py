"""Forgetting attention (FoX) with Adaptive Computation Pruning: the PyTorch reference
(`reference`), the pruning setting and thresholds (`acp`) and the Triton kernel (`kernel`).
The kernel is imported as `fox.kernel`, never from here: only it needs Triton."""

import os

from .acp import Acp
from .reference import doc_cumsum, doc_ids, reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton kernels run in its interpreter (tests without CUDA): the 'fox' backend works on CPU."""

__all__ = ["INTERPRET", "Acp", "doc_cumsum", "doc_ids", "reference"]
