# syntax=docker/dockerfile:1
# beamline server image.
#   GPU hosts (default): docker build -t beamline .
#   CPU-only hosts:      docker build --build-arg VARIANT=cpu -t beamline:cpu .
# Run: docker run -p 8000:8000 -v beamline-cache:/var/cache/beamline [--gpus all] beamline [--model M]
# The images carry no C/C++ compiler, so --torch-compile stops start-up with a message there;
# add g++ (CPU) or gcc (GPU, for Triton) in a derived image to use it.
# Each *-base stage provides Python and torch in the virtualenv /opt/venv; BuildKit builds only
# the one that VARIANT selects.

ARG VARIANT=gpu
ARG TORCH_VERSION=2.13.0

FROM python:3.12.11-slim-bookworm AS cpu-base
ARG TORCH_VERSION
ENV PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu \
        "torch==${TORCH_VERSION}"

# torch's Linux wheels on PyPI bring their own CUDA libraries; the host supplies only the driver.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS gpu-base
ARG TORCH_VERSION
ENV PATH=/opt/venv/bin:$PATH
# Ubuntu's archive keeps only the newest build of a package, so exact apt pins break rebuilds;
# the base image tag is what pins this layer.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}"

FROM ${VARIANT}-base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    BEAMLINE_CACHE_DIR=/var/cache/beamline \
    HF_HOME=/var/cache/beamline/huggingface
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/beamline beamline \
    && install -d -o beamline -g beamline /var/cache/beamline
# The build context is only what .dockerignore lets through (the package sources); it is mounted
# read-write for the build and discarded, so no copy of the sources stays in a layer.
RUN --mount=type=bind,source=.,target=/src,rw pip install --no-cache-dir /src

USER 10001:10001
WORKDIR /home/beamline
VOLUME ["/var/cache/beamline"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["beamline", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
