# The project image.  CPU torch by default; `--build-arg TORCH_INDEX=<a CUDA wheel index>` for a GPU worker.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements requirements
COPY protocol protocol
COPY eventstore eventstore
COPY projections projections
COPY participant participant
COPY workers workers
COPY trainer trainer
COPY gym_agent gym_agent
COPY simulation simulation
COPY migrations migrations
COPY cli cli
COPY benchmarks benchmarks
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"; \
    else pip install --no-cache-dir "$TORCH_SPEC"; fi \
    && pip install --no-cache-dir -c requirements/constraints.txt -e '.[all]'
ENTRYPOINT []
