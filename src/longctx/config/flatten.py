"""Params as dotted keys, for experiment trackers."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def flat(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> scalar, for experiment trackers."""
    out: dict[str, Any] = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, BaseModel):
            obj = obj.model_dump()
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}")
        else:
            out[key] = obj

    walk(config, prefix)
    return out
