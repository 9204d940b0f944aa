# syntax=docker/dockerfile:1
#
# oai-gemma on NVIDIA GPUs: an OpenAI-compatible chat-completions server for Gemma-3 (4b / 12b / 27b -it).
#
# Build:
#   docker build -t oai-gemma .
#
# Run (weights downloaded beforehand, e.g. `hf download google/gemma-3-12b-it --local-dir /path/to/gemma-3-12b-it`;
# the container never reaches the hub: HF_HUB_OFFLINE=1):
#   docker run --gpus all --shm-size 1g \
#     -v /path/to/gemma-3-12b-it:/models/gemma-3-12b-it:ro \
#     -e OAI_GEMMA_MODEL__SOURCE=/models/gemma-3-12b-it \
#     -p 8000:8000 oai-gemma
#
# Another size: pass its profile, and mount and point at its weights:
#   docker run --gpus all -v /path/to/gemma-3-27b-it:/models/gemma-3-27b-it:ro \
#     -e OAI_GEMMA_MODEL__SOURCE=/models/gemma-3-27b-it -p 8000:8000 \
#     oai-gemma oai-gemma serve --config configs/gemma-3-27b-it.toml --host 0.0.0.0
#
# Speed test without weights (random weights in the real shapes, see configs/hf/):
#   docker run --gpus all -e OAI_GEMMA_MODEL__SOURCE=configs/hf/gemma-3-12b-it \
#     -e OAI_GEMMA_MODEL__LOAD_FORMAT=dummy -p 8000:8000 oai-gemma
#
# Any setting can be changed with OAI_GEMMA_<SECTION>__<FIELD> env vars (oai_gemma/settings.py).

# torch 2.7.1 + CUDA 12.8 (Hopper and Blackwell); transformers 5 needs torch >= 2.6. Python 3.11.
ARG TORCH_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9
ARG FLASH_ATTN_VERSION=2.8.3

# ---- stage 1: a flash-attn wheel for this torch/CUDA/Python. Its setup fetches the matching prebuilt wheel from
# the flash-attention GitHub release, or else compiles it, which needs nvcc: hence the devel image, kept out of the
# final one.
FROM ${TORCH_IMAGE}-devel AS flash-attn
ARG FLASH_ATTN_VERSION
ENV MAX_JOBS=4
RUN pip install --no-cache-dir packaging psutil ninja wheel \
 && pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels "flash-attn==${FLASH_ATTN_VERSION}"

# ---- stage 2: the server
FROM ${TORCH_IMAGE}-runtime

# torch.compile on GPU: Triton builds its small kernel launchers with the host C compiler at run time, and the
# runtime image ships none (pytorch/pytorch#116696).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1

WORKDIR /app

COPY --from=flash-attn /wheels /tmp/wheels
RUN pip install /tmp/wheels/*.whl && rm -rf /tmp/wheels

# the package and its dependencies (torch comes from the base image and is kept: it already satisfies the pin)
COPY pyproject.toml README.md ./
COPY oai_gemma/ oai_gemma/
RUN pip install ".[gpu]" && rm -rf build *.egg-info

# the ready-made profiles, read from the working directory (configs/<profile>.toml)
COPY configs/ configs/

RUN useradd --create-home --uid 1000 app && mkdir -p /models && chown app:app /models
USER app

# weights go here, read-only is fine: -v /path/to/gemma-3-12b-it:/models/gemma-3-12b-it:ro
VOLUME ["/models"]
EXPOSE 8000

# liveness; loading and compiling a 27b model takes minutes, hence the long start period
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('OAI_GEMMA_SERVER__PORT', '8000'), timeout=4)" || exit 1

CMD ["oai-gemma", "serve", "--config", "configs/gemma-3-12b-it.toml", "--host", "0.0.0.0"]
