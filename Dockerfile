# The lbd sidecar image: the core daemon only (no Spark, no dev tools).
# Build: docker build -t lbd .
# Run beside a broker (see deploy/kubernetes/broker-with-lbd.yaml): the container needs its broker
# id and where etcd and Pulsar are, and binds all interfaces, so it must advertise a reachable
# address to the other sidecars:
#   docker run -e LBD_BROKER__BROKER_ID=broker-1 -e LBD_ETCD_ENDPOINTS=http://etcd:2379 \
#     -e LBD_PULSAR_URL=pulsar://pulsar:6650 -e LBD_GRPC__ADVERTISED_ADDR=10.0.0.5:7000 lbd
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lbd ./lbd
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/lbd --create-home lbd
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY deploy/lbd.example.toml /etc/lbd/lbd.toml
ENV LBD_GRPC__ADDR=0.0.0.0:7000 \
    LBD_METRICS__ADDR=0.0.0.0:9464
EXPOSE 7000 9464
USER lbd
WORKDIR /var/lib/lbd
ENTRYPOINT ["lbd"]
CMD ["serve", "--config", "/etc/lbd/lbd.toml"]
