# Prometheus for the compose `observability` profile: Debian's `prometheus` package on the same
# base as the other images, so no registry image is needed.
#
#   docker build -f deploy/docker/prometheus.Dockerfile -t rlfleet/prometheus:dev deploy/prometheus
#
# Unlike the rlfleet images this build needs the network (apt from the base image's Debian
# mirror). The scrape config is not baked in: compose mounts deploy/prometheus/prometheus.yml
# at /etc/prometheus/prometheus.yml (Debian's example config stays there otherwise).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE}
# No recommends: they would pull in node-exporter, which this image does not run. The package
# makes a `prometheus` system user with whatever UID is free; it gets UID 10001, as every
# rlfleet image runs as, so USER below is numeric and volume ownership is predictable.
# The classic web UI loads one file of libjs-moment-timezone; its data/ folder (212 MB of
# zone files in other formats) is never read, so dpkg skips it.
# hadolint ignore=DL3008
RUN echo 'path-exclude=/usr/share/javascript/moment-timezone/data/*' \
        >/etc/dpkg/dpkg.cfg.d/rlfleet-no-tz-data \
    && apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && groupmod --gid 10001 prometheus \
    && usermod --uid 10001 --gid 10001 prometheus \
    && chown -R prometheus:prometheus /var/lib/prometheus \
    && install -d -o prometheus -g prometheus /prometheus
USER 10001:10001
WORKDIR /prometheus
EXPOSE 9090
# python3 is in every base these images accept; the image gets no curl or wget for this alone.
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:9090/-/ready', timeout=2)"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=0.0.0.0:9090"]
