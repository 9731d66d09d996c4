# The project image: every command with the extras it uses (the main job, the workers, the reference
# agent, --ray, --metrics-port, --otel), on CPU torch unless told otherwise.  TORCH_BUILD is the torch
# build the image must hold (cpu or cuda), checked after the install: the build stops, saying so, when
# the index served the other one.  TORCH_INDEX is the wheel index of that build (default: pip's own).
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_BUILD=cpu
ARG TORCH_INDEX=""
WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements requirements
COPY protocol protocol
COPY payloads payloads
COPY eventstore eventstore
COPY projections projections
COPY participant participant
COPY workers workers
COPY trainer trainer
COPY gym_agent gym_agent
COPY gym_resources gym_resources
COPY simulation simulation
COPY migrations migrations
COPY console console
COPY cli cli
COPY benchmarks benchmarks
RUN if [ -n "$TORCH_INDEX" ]; then pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"; \
    else pip install --no-cache-dir "$TORCH_SPEC"; fi \
    && TORCH_BUILD="$TORCH_BUILD" python -c "import os, sys, torch; \
want = os.environ['TORCH_BUILD']; got = 'cuda' if torch.version.cuda else 'cpu'; \
sys.exit(None if got == want else f'torch {torch.__version__} is a {got} build, not {want}: \
give the wheel index of the {want} build with --build-arg TORCH_INDEX=URL')" \
    && pip install --no-cache-dir -c requirements/constraints.txt -e '.[all,ray,metrics,otel]'
ENTRYPOINT []
