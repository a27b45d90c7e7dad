"""longctx: make language models long-context, and measure them honestly."""

__version__ = "0.1.0"
