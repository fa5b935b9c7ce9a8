# lutb-moe expert server image: `lutb serve` on a CUDA GPU.
#
#   docker build -t lutb-moe:0.1.0 .
#   docker run --gpus 1 -p 50051:50051 -p 9400:9400 -v /path/to/ckpt:/checkpoints:ro \
#       -e LUTB_CHECKPOINT=/checkpoints --read-only --tmpfs /tmp:exec lutb-moe:0.1.0
#
# The CUDA version of the base image matches the PyTorch wheel index below (cu130: CUDA 13.0,
# NVIDIA driver >= 580 on the host). Change both FROM lines and TORCH_INDEX_URL together
# (tests/deploy checks that the two stages use the same base).
# The base is pinned by tag; for a reproducible release pin it by digest as well:
#   FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04@sha256:<digest>
# (`docker buildx imagetools inspect nvidia/cuda:13.0.2-runtime-ubuntu24.04` prints it).

# ---------------------------------------------------------------------------------------------
# builder: a virtual environment with torch (CUDA build) and lutb-moe with its `cuda` extra.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS builder

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu's archive keeps only the current build of a package, so exact apt pins break builds
# as soon as a security update lands; the base image tag (or digest) fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/lutb \
    PATH=/opt/lutb/bin:${PATH} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN python3 -m venv "${VIRTUAL_ENV}" \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels ./kernels
COPY client ./client
COPY server ./server
# A regular (not editable) install: the runtime stage copies only the venv, not /src.
# DL3013 (pin pip versions) is accepted here: this installs the project itself from the build
# context; its dependency ranges live in pyproject.toml, and torch, the one dependency whose
# build matters (CUDA), is pinned above.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[cuda]" \
    && python -c "import lutb_server.cli, lutb_kernels, lutb_client, torch, triton"

# ---------------------------------------------------------------------------------------------
# runtime: the venv, Python, and a C compiler for Triton (it builds its small CUDA launcher
# module with the system compiler the first time a kernel runs). No pip, no build context.
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

LABEL org.opencontainers.image.title="lutb-moe" \
      org.opencontainers.image.description="gRPC microservice serving MoE expert compute on 3-bit LUT-B weights" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Same reason as in the builder for not pinning apt versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libpython3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 lutb \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
        --shell /usr/sbin/nologin lutb

COPY --from=builder /opt/lutb /opt/lutb

# Kubernetes runs this image with a read-only root filesystem and an emptyDir on /tmp: every
# path the server or its libraries write to lives under /tmp.
ENV VIRTUAL_ENV=/opt/lutb \
    PATH=/opt/lutb/bin:${PATH} \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LUTB_HOST=0.0.0.0 \
    LUTB_PORT=50051 \
    LUTB_METRICS_PORT=9400 \
    LUTB_DEMO_DIR=/tmp/lutb-demo

USER 10001:10001
WORKDIR /tmp

# gRPC (lutb.v1.ExpertService + grpc.health.v1) and Prometheus /metrics over HTTP.
EXPOSE 50051 9400

# For plain Docker; Kubernetes uses its own gRPC probes (deploy/). Docker reserves exit
# code 2, which `lutb health` uses for "no answer", so every failure is reported as 1.
# start-period covers loading a large checkpoint.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["/bin/sh", "-c", "lutb health 127.0.0.1:${LUTB_PORT:-50051} --timeout 5 || exit 1"]

ENTRYPOINT ["lutb", "serve"]
CMD []
