# The load balancer in front of one organisation's share-server replicas (deploy/stack.yml):
# Debian's haproxy on the same base image as dpsketch, with deploy/replicated/haproxy.cfg.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/*
COPY haproxy.cfg /etc/dpsketch/haproxy.cfg
USER haproxy
EXPOSE 8101
# TLS passes through to the replicas (haproxy.cfg): the proxy's own check is that it accepts
# connections (whether a replica is ready is haproxy's /readyz check)
HEALTHCHECK --interval=5s --timeout=10s --start-period=5s --retries=10 \
  CMD ["python", "-I", "-S", "-c", "import socket; socket.create_connection(('127.0.0.1', 8101), 5).close()"]
# haproxy as PID 1 has no SIGTERM handler here, so docker stop / stack rm waited out the grace
# period and killed it; SIGUSR1 is its soft stop (stop listening, finish the requests in flight,
# bounded by hard-stop-after in haproxy.cfg).
STOPSIGNAL SIGUSR1
ENTRYPOINT ["haproxy", "-db", "-f", "/etc/dpsketch/haproxy.cfg"]
