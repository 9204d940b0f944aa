# syntax=docker/dockerfile:1
#
# oai-gemma on the CPU, the default image: the embedded gemma-3-270m, converted at build time (`oai-gemma prepare`),
# so that a container is ready in seconds. Runs as a non-root user; the root filesystem may be read-only.
#
# Build (the GPU image is Dockerfile.gpu; GIT_COMMIT is optional: /v1/server_info and the start-up log show it):
#   docker build --build-arg GIT_COMMIT="$(git rev-parse HEAD)" -t oai-gemma .
#
# Run:
#   docker run -p 8000:8000 oai-gemma
#
# Read-only root filesystem: the model cache was filled at build time; stored responses (`store: true`) go to the
# /home/app/.cache volume (a named one keeps them across containers), scratch files to /tmp:
#   docker run --read-only --tmpfs /tmp -v oai-gemma-data:/home/app/.cache -p 8000:8000 oai-gemma
#
# Another model (weights on the host, never the hub: HF_HUB_OFFLINE=1):
#   docker run -v /path/to/gemma-3-4b-it:/models/gemma-3-4b-it:ro -e OAI_GEMMA_MODEL__SOURCE=/models/gemma-3-4b-it \
#     -p 8000:8000 oai-gemma
#
# Any setting can be changed with OAI_GEMMA_<SECTION>__<FIELD> env vars (oai_gemma/settings.py) or flags:
#   docker run -p 8000:8000 oai-gemma oai-gemma serve --config configs/embedded-cpu.toml --host 0.0.0.0 --threads 4

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- stage 1: the install and the model cache. The install is the wheel's, as a user's (torch's CPU build from
# PyTorch's index, then the wheel); `oai-gemma prepare` converts the embedded model, compiles the native kernels
# with gcc (kept out of the final image), quantizes the weights for this machine's dtype and writes the grammar
# engine's token table: what a first start would do.
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0

# not pinned: Debian drops superseded versions from its mirrors (the base image pins the release)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    OAI_GEMMA_CACHE=/opt/oai-gemma/cache

# torch first, in a layer of its own: a change to the source does not download it again
RUN python -m venv /opt/venv \
 && pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

# the build context is what .dockerignore lets through: the package, its build files and metadata, the profiles
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip install /wheels/oai_gemma-*.whl \
 && oai-gemma prepare --config configs/embedded-cpu.toml

# ---- stage 2: the server: the venv and the filled cache, no compiler
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="oai-gemma" \
      org.opencontainers.image.description="OpenAI-compatible server for Gemma-3 on the CPU (the embedded gemma-3-270m)" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    OAI_GEMMA_CACHE=/opt/oai-gemma/cache

RUN useradd --create-home --uid 1000 --user-group app \
 && mkdir /home/app/.cache \
 && chown 1000:1000 /home/app/.cache

COPY --from=build /opt/venv /opt/venv
# the user's own, so that a start on a CPU with another dtype keeps its quantized weights; read-only works too
COPY --from=build --chown=1000:1000 /opt/oai-gemma/cache /opt/oai-gemma/cache

WORKDIR /app
COPY configs/ configs/

# numeric, so that Kubernetes' runAsNonRoot can check it
USER 1000:1000

# the one place the server writes at run time: the responses store (~/.cache/oai-gemma/responses.sqlite3)
VOLUME ["/home/app/.cache"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('OAI_GEMMA_SERVER__PORT', '8000'), timeout=4)"]

# the commit last: a new one rebuilds no layer above
ARG GIT_COMMIT=""
LABEL org.opencontainers.image.revision="${GIT_COMMIT}"
ENV OAI_GEMMA_GIT_COMMIT=${GIT_COMMIT}

CMD ["oai-gemma", "serve", "--config", "configs/embedded-cpu.toml", "--host", "0.0.0.0"]
