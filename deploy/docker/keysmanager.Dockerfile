# QUART-FaaS KeysManager host agent (python -m keysmanager.daemon), one per node (DaemonSet).
# Same packages as the plugin image, so it starts FROM it; build that one first, from the repository root:
#   docker build -f deploy/docker/plugin.Dockerfile -t ghcr.io/quart-faas/plugin:0.1.0 .
#   docker build -f deploy/docker/keysmanager.Dockerfile -t ghcr.io/quart-faas/keysmanager:0.1.0 .
# torch is the CPU wheel even for GPU nodes: the KeysManager and its zygotes never initialise CUDA
# (a CUDA context does not survive fork); the device copy happens in the stage's own process.
ARG BASE_IMAGE=ghcr.io/quart-faas/plugin:0.1.0

FROM ${BASE_IMAGE}

# Non-root (uid 12000, from the base image). Socket, segments and state come from the DaemonSet's volumes:
# KM_SOCKET, KM_SHM_DIR, KM_STATE_DIR (deploy/kubernetes/base/keysmanager.env).
USER app
WORKDIR /home/app

HEALTHCHECK --interval=10s CMD [ -S "${KM_SOCKET:-/run/quart/km.sock}" ] || exit 1

ENTRYPOINT ["python", "-m", "keysmanager.daemon"]
CMD []
