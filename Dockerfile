# Sluice server image: `sluice serve` as a non-root user, with the CUDA build of torch.
# How to build and run it, and what has and has not been checked: docs/deploy.md.
#
#   docker build -t sluice .
#   docker run --gpus all --init -p 50051:50051 -v /path/to/ckpt:/models/model:ro \
#     sluice --host 0.0.0.0 --model /models/model
#
# BASE_IMAGE: a CUDA runtime image (ubuntu:24.04 for a CPU-only image). torch's CUDA wheels carry
# their own CUDA libraries; the host needs an NVIDIA driver new enough for them and the NVIDIA
# container toolkit.
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# TORCH_INDEX_URL: empty = the default index, whose Linux x86_64 torch wheel is a CUDA build;
# set it to PyTorch's index of one CUDA version (or its CPU index) to choose another build.
ARG TORCH_INDEX_URL=
# Keep equal to the pin in scripts/setup.sh (a test checks it).
ARG TORCH_VERSION=2.13.0
# Match SLUICE_UID to the owner of mounted checkpoints and secrets if they are not world-readable.
ARG SLUICE_UID=10001

# gcc and the Python headers: Triton (the GPU attention kernels) and torch.compile build small C
# modules at run time.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Ubuntu's system Python refuses pip installs (PEP 668): Sluice gets its own venv.
ENV VIRTUAL_ENV=/opt/sluice \
    PATH=/opt/sluice/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/sluice \
    && pip install torch==${TORCH_VERSION} ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

# torch first (its own layer, the largest), then the sources: a code change rebuilds from here.
COPY . /src
WORKDIR /src
# The Python client is its own distribution (sluice-client, in clients/python) that the server
# depends on: install it from this tree before the server, so pip never looks for it on an index.
RUN pip install ./clients/python \
    && pip install . \
    && cd / && python -c "import torch, service.server, sluice_client; print('torch', torch.__version__)"

# Ubuntu's images ship a user `ubuntu` (uid 1000): remove it so SLUICE_UID may be 1000.
RUN if id ubuntu >/dev/null 2>&1; then userdel ubuntu && rm -rf /home/ubuntu; fi \
    && useradd --create-home --uid ${SLUICE_UID} --shell /usr/sbin/nologin sluice \
    && mkdir -p /home/sluice/.cache/sluice \
    && chown -R sluice:sluice /home/sluice
USER sluice
WORKDIR /home/sluice

# gRPC, and Prometheus metrics (served only with --metrics-port).
EXPOSE 50051 9400

# The start period covers loading a large checkpoint and capturing CUDA graphs; a success ends it
# early. With --port other than 50051, or TLS, override the check (docs/deploy.md).
HEALTHCHECK --interval=15s --timeout=10s --start-period=10m --retries=3 \
    CMD ["sluice", "health", "--target", "127.0.0.1:50051", "--wait", "0"]

ENTRYPOINT ["sluice", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-host", "0.0.0.0", "--metrics-port", "9400"]
