# QUART-FaaS gateway plugin in front of an OpenFaaS gateway (python -m gateway_plugin.standalone).
# Built from the repository root:
#   docker build -f deploy/docker/plugin.Dockerfile -t ghcr.io/quart-faas/plugin:0.1.0 .
# The KeysManager image (keysmanager.Dockerfile) starts FROM this one: same packages, other command.
ARG PYTHON_VERSION=3.11
ARG DEBIAN_OS=slim-bookworm

FROM --platform=${TARGETPLATFORM:-linux/amd64} python:${PYTHON_VERSION}-${DEBIAN_OS}

ARG UPGRADE_PACKAGES=false
RUN apt-get -qy update \
    && if [ "${UPGRADE_PACKAGES}" = "true" ] || [ "${UPGRADE_PACKAGES}" = "1" ]; then apt-get -qy upgrade; fi \
    && rm -rf /var/lib/apt/lists/*

# Non-root user with the uid faas-netes gives functions under functions.setNonRootUser (12000), so the
# KeysManager's socket (mode 0600) and segments are reachable from stage pods of the same uid.
RUN addgroup --system --gid 12000 app \
    && adduser app --system --uid 12000 --ingroup app --home /home/app \
    && chown app /home/app

WORKDIR /opt/quart
# Runtime pins from requirements.txt (everything above "# tests and lint"), less what only the offline
# tools use (the partitioner's deepspeed, plots, the simulator). torch from the CPU wheel index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY requirements.txt ./
RUN sed '/^# tests and lint/,$d' requirements.txt | grep -vE '^(deepspeed|matplotlib|simpy|tqdm)==' > runtime.txt \
    && pip install --no-cache-dir --extra-index-url ${TORCH_INDEX_URL} -r runtime.txt

# The packages the plugin and the KeysManager run, under their import names (pyproject.toml's package-dir): the
# stage library, the KeysManager, the shared HTTP transport, the decision kernel and the plugin. Not the
# embedded gateway (quart_provider) nor the offline tools (quart_tools): tests/unit/test_structure.py keeps the plugin
# from importing either.
COPY template/pipeline-stage/quart_stage ./lib/quart_stage
COPY keysmanager ./lib/keysmanager
COPY transport ./lib/quart_transport
COPY kernel ./lib/quart_kernel
COPY gateway-plugin ./lib/gateway_plugin
ENV PYTHONPATH=/opt/quart/lib

USER app
WORKDIR /home/app
ENV PYTHONUNBUFFERED=1

EXPOSE 8081
HEALTHCHECK --interval=10s CMD python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8081/healthz', timeout=2)" || exit 1

ENTRYPOINT ["python", "-m", "gateway_plugin.standalone"]
CMD ["--bind", "0.0.0.0", "--port", "8081"]
