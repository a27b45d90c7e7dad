"""One thin module per DVC stage: read params, call the library, write the stage's outputs."""

import time

STARTED = time.perf_counter()
"""When the stage's process began importing it (MLflow, torch and the eval take seconds): the eval
stage's first line says where its start went."""
