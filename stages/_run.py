"""What every stage shares: the project's file layout, argument parsing and error handling."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from longctx import config
from longctx.data.tokenizer import TextTokenizer
from longctx.errors import ConfigError, DataError, LongctxError, Terminated, WorkspaceBusy
from longctx.io import DISK_ERRNOS, REPLACED, check_room, pipeline_holder, read_json
from longctx.tracking.store import local_folders

DATA = Path("data")
CORPORA = DATA / "corpora"
TOKENS = DATA / "tokens"
PACKED = DATA / "packed"
METRICS = Path("metrics")
PLOTS = Path("plots")


def main(name: str, run: Callable[[config.Params, Path], None],
         trains: Callable[[config.Params], list] | None = None, models: bool = False,
         writes: tuple[Path, ...] = (), again: str | None = None) -> None:
    """Parse --params, run the stage from the project root, turn user errors into exit code 2.
    A stage that runs models (`models`, or `trains` listing its training configs) first checks
    that the attention backend runs on this machine; a training stage, that its configs fit
    train.nproc ranks and the model's heads. The folders it `writes` (and metrics/, plots/) must
    take writes before any work; a disk that fills up or turns read-only mid-stage is one line
    and exit 2 too. With train.nproc > 1 it then starts itself again under torchrun, one process
    per GPU (gloo processes on a CPU machine); rank 0 writes the outputs. With train.slurm.enabled
    (outside a Slurm job) it runs as a batch job instead, and waits for it. `again`: what `dvc
    repro <name>` does after a stop (a training stage goes on from its last checkpoint, others
    run again)."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{name}", description=run.__doc__)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args()
    rank0 = os.environ.get("RANK", "0") == "0"
    signal.signal(signal.SIGTERM, _terminate)
    try:
        cfg = config.load(args.params)
        # (torchrun's workers, whose ranks it checked, have LOCAL_RANK; a PyTorchJob's pods have RANK without it)
        launcher = "LOCAL_RANK" not in os.environ
        if launcher and (holder := pipeline_holder(Path.cwd())):
            raise WorkspaceBusy(f"the main command runs in this workspace ({holder}); a stage run beside it would "
                                "race it for the same outputs: wait for it to finish, or stop it, then rerun this")
        if launcher:
            for folder in (*writes, METRICS, PLOTS):
                check_room(folder, 0, f"the {name} stage's outputs")
            for folder in local_folders(cfg.tracking, Path.cwd()):
                try:
                    check_room(folder, 0, "the MLflow store's files")
                except DataError as e:
                    raise DataError(f"{e}; or set tracking.enabled: false") from None
        if launcher and (models or trains):
            _check_backend(cfg, args.params)
        if launcher and trains:
            from longctx.train import launch, slurm

            if cfg.train.slurm.enabled and "SLURM_JOB_ID" not in os.environ:  # (in a job: run in it)
                _, per_node = slurm.per_node(cfg.train)
                _check_layouts(name, cfg, trains(cfg), per_node * cfg.train.nodes, cfg.train.nodes)
                sys.exit(slurm.run(name, args.params, cfg.train, Path.cwd()))
            on, n = launch.nodes(cfg.train), _nproc(cfg.train.nproc)
            _check_layouts(name, cfg, trains(cfg), n * on.count, on.count)
            if n * on.count > 1:
                cmd = launch.torchrun(name, args.params, n, on)
                across = f" on each of {on.count} nodes ({on.source}, rendezvous {on.endpoint})" if on.count > 1 else ""
                print(f"{name}: {n} processes{across}: {' '.join(cmd[1:])}", file=sys.stderr)
                code = subprocess.run(cmd).returncode
                if code != 0 and on.count > 1:
                    print(f"{name}: stopped on this node (torchrun exit {code}): a process here or another node failed "
                          f"(its error is above); {_resumes_from(name)}", file=sys.stderr)
                sys.exit(code)
        run(cfg, Path.cwd())
    except LongctxError as e:  # every rank says it: the launcher may stop the others first
        print(f"{name}: error{'' if rank0 else ' (rank ' + os.environ['RANK'] + ')'}: {e}{_under_dvc()}",
              file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a disk that filled up, or a folder that stopped taking writes, mid-stage
        if e.errno not in DISK_ERRNOS:
            raise
        where = e.filename or ", ".join(map(str, writes)) or "an output"
        print(f"{name}: error: {where}: {e.strerror}{_under_dvc() or _what_changed()}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated): a training stage resumes where it stopped
        if rank0:
            what = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            rerun = again or ("goes on from its last checkpoint" if trains else "runs it again")
            print(f"{name}: {what}{_under_dvc() or '; no outputs were changed'}; `dvc repro {name}` {rerun}",
                  file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)


def _resumes_from(stage: str) -> str:
    """Where a rerun of a training stage goes on from: its newest complete checkpoint."""
    from longctx.train import checkpoint

    found = sorted((c for run in Path("runs", stage).glob("*/checkpoints") for c in checkpoint.checkpoints(run)),
                   key=lambda c: c.stat().st_mtime)
    if not found:
        return f"no checkpoint was written: `dvc repro {stage}` starts it again"
    return f"`dvc repro {stage}` goes on from {found[-1]}"


def _terminate(signum, frame) -> None:
    raise Terminated()


def _under_dvc() -> str:
    """What became of the stage's earlier outputs when DVC ran it: DVC removes a stage's outputs
    before its command runs (the stage itself never touches them until it succeeds), and its cache
    still holds them."""
    stage = os.environ.get("DVC_STAGE")
    if not stage:
        return ""
    return f" (DVC removed this stage's earlier outputs before it ran: `dvc checkout {stage}` restores them)"


def _what_changed() -> str:
    """What a stage that failed mid-way had already replaced (io.REPLACED), or that it replaced
    nothing; its scratch under runs/ is not an output."""
    done = list(dict.fromkeys(str(p) for p in REPLACED if Path(p).parts[:1] != ("runs",)))
    if not done:
        return "; outputs from before this run are intact"
    return f"; this run had already replaced {', '.join(done)} (its other outputs are from before it): rerun the stage"


def tokenizer() -> tuple[TextTokenizer, dict]:
    """data/tokens/tokenizer and the token index, the tokenizer the one tokenize made the tokens
    with: a folder replaced since would be read by eval beside checkpoints trained on the other,
    and would ship in a model's HF export beside its summary naming the other."""
    index = read_json(TOKENS / "index.json", "token index")
    tok = TextTokenizer.load(TOKENS / "tokenizer")
    if tok.fingerprint != index["fingerprint"]:
        raise DataError(f"{TOKENS / 'tokenizer'}: changed since tokenize ran (fingerprint {tok.fingerprint}, the "
                        f"tokens were made with {index['fingerprint']}): restore it or rerun the tokenize stage")
    return tok, index


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows as CSV (DVC plots, MLflow tables); the header is the union of the rows' keys."""
    import csv

    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)) or ["empty"])
        writer.writeheader()
        writer.writerows(rows)


def compute_device():
    """The GPU when there is one (single-process stages), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check_backend(cfg: config.Params, source: str) -> None:
    """model.attention_backend must run on this machine's device (a CUDA kernel on a CPU-only
    machine is a params error, not a traceback when the model is built)."""
    from longctx.model.attention import resolve

    m = cfg.model
    try:
        resolve(m.attention_backend, compute_device(), fox=m.arch == "fox" or m.position == "alibi")
    except ValueError as e:
        raise ConfigError(f"{source}: model.attention_backend: {e}") from None


def _check_layouts(name: str, cfg: config.Params, stages: list, n: int, nodes: int) -> None:
    """The training configs fit `n` ranks on `nodes` machines (and the base model's heads, when
    training starts from it)."""
    from longctx.train.parallel import check_layout

    heads = cfg.model.n_heads if cfg.train.pretrain.init == "base" else None
    for i, stage in enumerate(stages):
        check_layout(stage, n, f"train.{name}.{'stages.' + str(i) + '.' if name == 'pretrain' else ''}", heads,
                     nodes)


def _nproc(value: int | str) -> int:
    if value != "auto":
        return int(value)
    import torch

    return max(1, torch.cuda.device_count())
