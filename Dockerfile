# The image a cluster runs the pipeline in (the Kubernetes jobs of `python -m longctx.train.kubernetes`, the
# Prefect gpu deployment's $LONGCTX_IMAGE): CUDA PyTorch, the project with its pipeline tools (DVC, Prefect,
# MLflow) and its GPU kernels. A run's workspace (a clone of this project with its data) is mounted at /workspace.
#   docker build -t registry.example.com/longctx:$(git rev-parse --short HEAD) .
#   docker push registry.example.com/longctx:$(git rev-parse --short HEAD)
# The devel base has nvcc for flash-attn's build where no wheel matches (MAX_JOBS bounds its memory).
ARG BASE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-devel
FROM ${BASE}

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 MAX_JOBS=8 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1 PYTHONPYCACHEPREFIX=/tmp/pycache
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/longctx
# requirements first: a change to the code alone reuses the installed layer
COPY pyproject.toml README.md ./
COPY src/longctx/__init__.py src/longctx/__init__.py
RUN pip install --no-build-isolation ".[gpu]" && pip uninstall -y longctx
COPY src src
COPY stages stages
COPY pipelines pipelines
COPY dvc.yaml params.yaml prefect.yaml ./
RUN pip install --no-deps --no-build-isolation -e . && python -c "import longctx, stages, pipelines"

ENV PYTHONPATH=/opt/longctx
WORKDIR /workspace
CMD ["python", "-m", "pipelines", "--help"]
