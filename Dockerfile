# GPU image for clusters: NVIDIA's PyTorch container (CUDA, NCCL, cuDNN, torch, Transformer Engine)
# plus what it lacks (megatron-core, Hydra, ...), installed under the container's own pins.
#   docker build -t cp-recipe .
#   docker run --gpus all --rm -v "$PWD/outputs:/opt/recipe/outputs" cp-recipe cp=2
#
# Base: 25.12-py3, the newest release whose notes could be read when this was written (it could
# not be pulled or built here): Python 3.12 (megatron-core 0.19.2 needs >= 3.12), CUDA 13.1 (the
# `te` extra of megatron-core 0.19 asks for Transformer Engine's cu13 build, so the image's TE is
# the right kind and nothing is compiled), torch 2.10 (megatron-core needs >= 2.6). The recipe is
# tested on CPU with torch 2.13/2.14, not with 2.10, and the exact TE release in the image was not
# read. A newer NGC tag works the same way: --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

WORKDIR /opt/recipe

# The dependency layer depends only on pyproject.toml: code edits rebuild from the COPY below.
# The image sets PIP_CONSTRAINT (a pin for every package it ships); docker_requirements.py leaves
# out torch and TE and names a pinned package without a version, so pip keeps the image's and
# installs only what is missing. `pip check` would fail on packages of the base itself; the
# constraint is what keeps the image consistent.
COPY pyproject.toml README.md ./
COPY scripts/docker_requirements.py scripts/
RUN python scripts/docker_requirements.py --dev > /tmp/requirements-image.txt \
    && pip install --no-cache-dir -r /tmp/requirements-image.txt \
    && rm /tmp/requirements-image.txt

COPY conf ./conf
COPY hydra_plugins ./hydra_plugins
COPY recipe ./recipe
COPY scripts ./scripts
COPY benchmarks ./benchmarks
COPY tests ./tests
COPY train.py ./
RUN pip install --no-cache-dir --no-deps -e .

# wandb writes into each run directory unless a key is given (logger.wandb.mode=online).
ENV WANDB_MODE=offline
ENTRYPOINT ["python", "train.py"]
