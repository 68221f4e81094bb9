# The lbd sidecar image: the core daemon only (no Spark, no dev tools).
# Build: docker build -t lbd .    Run: docker run --rm lbd --help
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
USER lbd
WORKDIR /var/lib/lbd
ENTRYPOINT ["lbd"]
CMD ["config", "validate", "/etc/lbd/lbd.toml"]
