"""Typed, validated params.

A run's params are a named profile (``src/longctx/profiles/<name>.yaml``) with the sections of
``params.yaml`` merged over it key by key (a ``null`` drops a key). Everything is validated
before any work starts: unknown keys, wrong types and impossible values are errors that name
the dotted key. The schema is schema.py (the whole and the model; the data sections in
data_params.py, train in train_params.py, rope_search and eval in eval_params.py), what ties
its sections together checks.py, reading and merging files loading.py, the trackers' view
flatten.py; `python -m longctx.config` prints the params in force.
"""

from .base import Strict
from .data_params import (
    BPEParams,
    CorporaParams,
    DomainParams,
    PackParams,
    SourceParams,
    SplitParams,
    TokenizeParams,
    TokenizerParams,
)
from .eval_params import EvalParams, HelmetParams, RopeSearchParams
from .flatten import flat
from .loading import available_profiles, load, merge, profile_path, resolve
from .schema import ModelParams, Params, TrackingParams
from .train_params import PretrainParams, PretrainStageParams, RunParams, StageParams, TrainParams

__all__ = ["BPEParams", "CorporaParams", "DomainParams", "EvalParams", "HelmetParams", "ModelParams", "PackParams",
           "Params", "PretrainParams", "PretrainStageParams", "RopeSearchParams", "RunParams", "SourceParams",
           "SplitParams", "StageParams", "Strict", "TokenizeParams", "TokenizerParams", "TrackingParams",
           "TrainParams", "available_profiles", "flat", "load", "merge", "profile_path", "resolve"]
