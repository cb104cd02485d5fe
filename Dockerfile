# Tessera's image: `docker build -t tessera .` from the repository's root.
# docs/DEPLOYING.md shows it with deploy/compose (a coordinator and three
# nodes) and deploy/kubernetes.

# The build: the `tessera` binary, release profile, from the locked
# dependencies (Lua is compiled from the vendored sources, hence cc).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY crates crates
RUN cargo build --release --locked -p tessera-cli \
    && install -m 0755 target/release/tessera /usr/local/bin/tessera

# The image: the binary, redis-cli for health checks, a `tessera` user that
# owns /var/lib/tessera, where a node or coordinator keeps its state.
FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-tools ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --user-group --uid 10001 --home-dir /var/lib/tessera --create-home \
        --shell /usr/sbin/nologin tessera
COPY --from=build /usr/local/bin/tessera /usr/bin/tessera
COPY LICENSE README.md /usr/share/doc/tessera/
USER tessera
WORKDIR /var/lib/tessera
VOLUME ["/var/lib/tessera"]
# Clients on 7379; a cluster node's peers on the client port + 10000; a
# coordinator on 7000; metrics wherever --metrics-bind says (9121 here).
EXPOSE 7379 17379 7000 9121
HEALTHCHECK --interval=10s --timeout=3s CMD redis-cli -p 7379 ping | grep -q PONG
ENTRYPOINT ["/usr/bin/tessera"]
CMD ["serve", "--bind", "0.0.0.0", "--port", "7379", "--dir", "/var/lib/tessera"]
