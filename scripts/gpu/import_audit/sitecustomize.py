"""Put this folder on PYTHONPATH with LONGCTX_IMPORT_LOG=<file>: every Python process of the run
(the main command, DVC's stages, the Prefect server) appends each top-level module it imports to
that file as it imports it (a server killed at the end has written its own already).
scripts/gpu/wheels.py --imports keeps only the distributions a real run imported, so the GPU
machine's wheel folder holds what the pipeline needs and not every optional backend its
requirements declare (a Postgres driver, Redis, a Databricks SDK)."""

import os
import sys

_LOG = os.environ.get("LONGCTX_IMPORT_LOG")


class _Recorder:
    """A finder that finds nothing: it notes each top-level name asked for and lets the others look."""

    def __init__(self, log: str):
        self.log, self.seen = log, set(sys.modules)

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in self.seen:
            self.seen.add(top)
            with open(self.log, "a") as f:  # one short O_APPEND write: processes do not interleave
                f.write(top + "\n")
        return None


if _LOG:
    sys.meta_path.insert(0, _Recorder(_LOG))
