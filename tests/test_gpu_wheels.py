"""scripts/gpu/wheels.py: the wheel folder for a GPU machine without internet is the project's
requirements closed over their own at the versions installed here, less what the image has."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "gpu"))
import wheels as gpu_wheels  # noqa: E402


def test_the_closure_is_what_this_install_resolved():
    needed = gpu_wheels.closure()
    assert "longctx" not in needed
    for name in ("mlflow", "prefect", "dvc", "pydantic", "sqlalchemy"):
        assert needed[name] == md.version(name), name
    assert "pytest" not in needed and "ruff" not in needed  # the test extra is not the run's


def test_what_the_image_has_is_left_out(tmp_path):
    image = tmp_path / "image.txt"
    image.write_text("# pip list --format=freeze\nTorch==2.11.0\nnumpy==2.5.2\nPyYAML==6.0.1\n")
    wanted = gpu_wheels.lacking(gpu_wheels.closure(), gpu_wheels.read_freeze(image))
    assert "torch" not in wanted and "numpy" not in wanted and "pyyaml" not in wanted  # any version serves
    assert wanted["prefect"] == md.version("prefect")
    image.write_text("torch==2.11.0\nnumpy\n")
    with pytest.raises(SystemExit, match=r"image.txt:2: not a name==version line"):
        gpu_wheels.read_freeze(image)


def test_without_drops_a_requirement_and_what_only_it_needs():
    full, lean = gpu_wheels.closure(), gpu_wheels.closure(without=("lm-eval",))
    assert "lm-eval" in full and "lm-eval" not in lean
    assert "sacrebleu" in full and "sacrebleu" not in lean  # only lm-eval needs it
    assert "numpy" in lean and "pyarrow" in lean  # others need these too


def test_a_folder_over_the_budget_names_its_largest_wheels(tmp_path):
    wheels = []
    for name, size in (("big-1.0-py3-none-any.whl", 3000), ("small-1.0-py3-none-any.whl", 100)):
        (tmp_path / name).write_bytes(b"x" * size)
        wheels.append(tmp_path / name)
    assert gpu_wheels.check_size(wheels, 4000) == 3100
    with pytest.raises(SystemExit, match=r"over the 0 MiB .* big-1.0-py3-none-any.whl"):
        gpu_wheels.check_size(wheels, 2000)


def test_the_import_audit_records_every_process_of_a_run(tmp_path):
    log = tmp_path / "imports.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts" / "gpu" / "import_audit"), "LONGCTX_IMPORT_LOG": str(log)}
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import yaml.constructor'], check=True)"
    subprocess.run([sys.executable, "-c", f"import tomllib; {child}; import os; os._exit(0)"], env=env, check=True)
    names = log.read_text().split()
    assert {"tomllib", "yaml", "subprocess"} <= set(names)  # the parent's, then the child's (os._exit: no atexit)
    assert "yaml.constructor" not in names and names.count("yaml") == 1


def test_imports_keep_only_what_a_run_imported(tmp_path):
    wanted = {"pyyaml": "6.0", "sqlalchemy": "2.0", "asyncpg": "0.30"}
    log = tmp_path / "imports.txt"
    log.write_text("yaml\nsqlalchemy\njson\n")
    assert gpu_wheels.imported(wanted, log) == {"pyyaml": "6.0", "sqlalchemy": "2.0"}  # module -> distribution
    log.write_text("")
    with pytest.raises(SystemExit, match="no module names"):
        gpu_wheels.imported(wanted, log)


def test_slimming_drops_the_parts_and_their_record_lines(tmp_path):
    import zipfile

    wheel = tmp_path / "mlflow-3.17.2-py3-none-any.whl"
    record = ("mlflow/__init__.py,sha256=a,1\nmlflow/server/js/build/index.js,sha256=b,2\n"
              "mlflow-3.17.2.dist-info/RECORD,,\n")
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("mlflow/__init__.py", "x = 1\n")
        z.writestr("mlflow/server/js/build/index.js", "ui" * 1000)
        z.writestr("mlflow/server/__init__.py", "")
        z.writestr("mlflow-3.17.2.dist-info/RECORD", record)
    gpu_wheels.slim(wheel, gpu_wheels.SLIM["mlflow"])
    with zipfile.ZipFile(wheel) as z:
        assert z.namelist() == ["mlflow/__init__.py", "mlflow/server/__init__.py", "mlflow-3.17.2.dist-info/RECORD"]
        assert z.read("mlflow-3.17.2.dist-info/RECORD").decode() == (
            "mlflow/__init__.py,sha256=a,1\nmlflow-3.17.2.dist-info/RECORD,,\n")


def test_the_budget_is_what_the_tree_leaves(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\n")
    (tmp_path / "new.txt").write_bytes(b"n" * 1000)  # untracked, not ignored: it travels
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"w" * 5000)  # ignored: carried apart
    assert gpu_wheels.tree_bytes(tmp_path) == 1000 + len("/.whl/\n")
