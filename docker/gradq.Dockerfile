# One Dockerfile, two images (compose.yaml picks the target):
#   aggregator: gradq without torch (`gradq serve`): grpcio, protobuf, numpy and
#               numba, whose kernels decode-accumulate and re-encode every round;
#   worker:     gradq[demo] with torch and scikit-learn (`gradq worker`).
# Both carry qcore's numba kernels compiled at build, so a new container starts
# at once. BASE_IMAGE defaults to the public Python image; CI passes a local
# Debian base and PIP_OPTIONS="--no-index --find-links /wheelhouse" (docker/build-base.sh).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS source
COPY pyproject.toml README.md /src/
COPY qcore /src/qcore
COPY proto /src/proto
COPY server /src/server
COPY client /src/client
COPY cli /src/cli
COPY docker/slim-venv.sh docker/compile_kernels.py /src/docker/
# Only a README unless docker/build-base.sh filled it; pip reads it only with --find-links.
COPY docker/wheelhouse /wheelhouse

FROM source AS aggregator-install
ARG PIP_OPTIONS=""
RUN python3 -m venv /opt/gradq \
 && /opt/gradq/bin/pip install --no-cache-dir --disable-pip-version-check ${PIP_OPTIONS} /src \
 && sh /src/docker/slim-venv.sh /opt/gradq \
 && /opt/gradq/bin/python /src/docker/compile_kernels.py

FROM source AS worker-install
ARG PIP_OPTIONS=""
RUN python3 -m venv /opt/gradq \
 && /opt/gradq/bin/pip install --no-cache-dir --disable-pip-version-check ${PIP_OPTIONS} "/src[demo]" \
 && sh /src/docker/slim-venv.sh /opt/gradq \
 && /opt/gradq/bin/python /src/docker/compile_kernels.py

# Final stages copy only the virtual environment (with the kernel cache): no sources, no wheelhouse.
FROM ${BASE_IMAGE} AS aggregator
# Lets tests/docker find untagged leftovers of these images (and only these).
LABEL org.opencontainers.image.vendor=gradq
COPY --from=aggregator-install /opt/gradq /opt/gradq
ENV PATH=/opt/gradq/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 50051 9100
HEALTHCHECK --interval=2s --timeout=3s --retries=30 CMD ["python", "-m", "gradq.server.healthcheck"]
ENTRYPOINT ["gradq", "serve"]

FROM ${BASE_IMAGE} AS worker
LABEL org.opencontainers.image.vendor=gradq
COPY --from=worker-install /opt/gradq /opt/gradq
ENV PATH=/opt/gradq/bin:$PATH PYTHONUNBUFFERED=1
ENTRYPOINT ["gradq", "worker"]
