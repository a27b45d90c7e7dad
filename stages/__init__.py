"""One thin module per DVC stage: read params, call the library, write the stage's outputs."""
