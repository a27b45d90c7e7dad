"""Writing a GPU benchmark's JSON: named by benchmark, device and date."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch


def write_result(out: Path, benchmark: str, fields: dict, device: str | None = None) -> Path:
    """`device` defaults to the current CUDA device's name."""
    date = datetime.date.today().isoformat()
    device = device or torch.cuda.get_device_name()
    result = {"benchmark": benchmark, "date": date, "device": device, "torch": torch.__version__, **fields}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{benchmark}-{device.replace(' ', '-').lower()}-{date}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
