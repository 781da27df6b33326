# PostgreSQL for one organisation's replicated share server (deploy/stack.yml), from the same base
# image as dpsketch (no registry needed: deploy/base-image.sh makes it locally). Build with the
# context deploy/replicated. Debian's postgresql; the entrypoint creates the cluster on first
# start in the volume, with the password from $POSTGRES_PASSWORD_FILE or $POSTGRES_PASSWORD.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/lib/postgresql/data /run/postgresql \
 && chown -R postgres:postgres /var/lib/postgresql /run/postgresql
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
USER postgres
ENV PGDATA=/var/lib/postgresql/data POSTGRES_DB=dpsketch
VOLUME ["/var/lib/postgresql/data"]
EXPOSE 5432
HEALTHCHECK --interval=2s --timeout=3s --start-period=20s --retries=30 \
  CMD ["sh", "-c", "pg_isready -h 127.0.0.1 -q"]
# SIGTERM is PostgreSQL's "smart" shutdown, which waits for every client (the replicas' pools)
# to leave: docker stop would wait out its grace period and SIGKILL it, and the next start
# would run crash recovery. SIGINT is the fast shutdown: sessions end, a clean checkpoint.
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
