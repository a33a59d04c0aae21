# The compose `observability` profile's trace collector and viewer: Arize Phoenix (PyPI
# `arize-phoenix`), an OpenTelemetry OTLP receiver (gRPC :4317, HTTP :6006/v1/traces) that
# stores spans in SQLite and shows them in a web UI (:6006). It is what the services'
# `RLFLEET_TRACING=otlp` exporters send to in compose. Built on the same base as the other
# images, so no registry image is needed:
#
#   docker build --network=none -f deploy/docker/phoenix.Dockerfile -t rlfleet/phoenix:dev DIR
#
# DIR holds wheels/: `arize-phoenix` and its ~140 dependencies as wheels, downloaded on the host
# by deploy/scripts/build-images.sh (which pins the version). Nothing is fetched in the build.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Labelled so deploy/scripts/build-images.sh prunes this stage once the image is built
# (untagged, it would stay behind as a dangling image of up to several GB).
ARG RLFLEET_STAGE_KEY=""
LABEL org.rlfleet.stage=build org.rlfleet.stage-key="${RLFLEET_STAGE_KEY}"
COPY wheels/ /wheels/
RUN python3 -m venv /opt/phoenix \
    && /opt/phoenix/bin/pip install --no-cache-dir --no-index --find-links /wheels arize-phoenix

FROM ${BASE_IMAGE}
RUN useradd --create-home --uid 10001 --user-group phoenix \
    && install -d -o phoenix -g phoenix /data
COPY --from=build /opt/phoenix /opt/phoenix
# Phoenix's own usage telemetry is off: a self-hosted stack sends nothing out. Spans live in
# /data (the `traces` volume in compose); OMP_NUM_THREADS=1 as in every image of the stack.
ENV PATH=/opt/phoenix/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    PHOENIX_WORKING_DIR=/data \
    PHOENIX_HOST=0.0.0.0 \
    PHOENIX_PORT=6006 \
    PHOENIX_GRPC_PORT=4317 \
    PHOENIX_TELEMETRY_ENABLED=false
USER 10001:10001
WORKDIR /home/phoenix
# 6006: UI, REST API and OTLP/HTTP; 4317: OTLP/gRPC.
EXPOSE 6006 4317
# /readyz answers once the span database is reachable (/healthz only says the server is up).
HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:6006/readyz', timeout=2)"]
ENTRYPOINT ["phoenix"]
CMD ["serve"]
