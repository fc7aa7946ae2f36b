# GPU image for clusters. NVIDIA's PyTorch container brings CUDA, NCCL, torch and Transformer
# Engine; the recipe adds megatron-core and its pure-Python dependencies (pinned in
# pyproject.toml) without touching the container's torch.
#   docker build -t cp-recipe .
#   docker run --gpus all --rm -v "$PWD/outputs:/opt/recipe/outputs" cp-recipe cp=2
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

WORKDIR /opt/recipe
COPY pyproject.toml README.md ./
COPY scripts/docker_requirements.py scripts/
RUN python scripts/docker_requirements.py --dev > /tmp/requirements-image.txt \
    && pip install --no-cache-dir -r /tmp/requirements-image.txt

COPY recipe ./recipe
COPY conf ./conf
COPY scripts ./scripts
COPY benchmarks ./benchmarks
COPY tests ./tests
COPY train.py ./
RUN pip install --no-cache-dir --no-deps -e .

# wandb writes into each run directory unless a key is given (logger.wandb.mode=online).
ENV WANDB_MODE=offline
ENTRYPOINT ["python", "train.py"]
