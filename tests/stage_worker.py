"""A process that imports what every stage imports (torch, MLflow, the project) once, then forks
one child a request that runs `python -m stages.<name>` as the interpreter would: its own
session, folder, environment, stdout and stderr, exit code and atexit hooks. A stage process
spends ~3 s of CPU importing before its first line runs; the suite starts some fifty of them
to check how each refuses bad input, so it pays that once (conftest.stage_process). It never
computes itself: a forked child then starts its own thread pools.

Requests are JSON lines on stdin {stage, cwd, env, stdout, stderr, timeout}; each answer is a
line {returncode} once that child has exited."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import sys
import traceback

import mlflow  # noqa: F401
import torch  # noqa: F401

import longctx.tracking.runs  # noqa: F401
import stages._run  # noqa: F401
import stages._train  # noqa: F401


def _child(req: dict) -> None:
    os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, fd)
        os.close(out)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    signal.alarm(int(req["timeout"]))  # past it SIGALRM ends the child, as subprocess's timeout would
    name = f"stages.{req['stage']}"
    sys.argv = [name]
    sys.modules.pop(name, None)
    code = 0
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
