"""`python -m longctx.config [params.yaml]`: print the params in force, profile merged in."""

from __future__ import annotations

import sys

import yaml

from ..errors import ConfigError
from .loading import load


def main() -> None:
    """`python -m longctx.config [params.yaml]`: print the params in force, profile merged in."""
    path = sys.argv[1] if len(sys.argv) > 1 else "params.yaml"
    try:
        cfg = load(path)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False), end="")


if __name__ == "__main__":
    main()
