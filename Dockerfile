# The gateway image: `docker build -t kv-gateway .` then `docker run -p 8080:8080 kv-gateway serve --config ...`
# The runtime only: the simulator (simulator/) and the benchmark (bench/) stay out, and `gateway --help`
# there says which extra would bring them.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY plugins ./plugins
COPY profiles ./profiles
RUN pip install --no-cache-dir . && useradd --system --uid 10001 gateway
USER gateway
EXPOSE 8080
ENTRYPOINT ["gateway"]
CMD ["serve", "--config", "/etc/gateway/gateway.yaml"]
