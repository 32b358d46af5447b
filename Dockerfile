# The gateway image: `docker build -t kv-gateway .` then `docker run -p 8080:8080 kv-gateway serve --config ...`
# The runtime only: the simulator (simulator/) and the benchmark (bench/) stay out, and `gateway --help`
# there says which extra would bring them. The prefix index has a compiled part (gateway/kv/native/): built
# into a wheel in a stage with a C compiler.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY plugins ./plugins
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim
WORKDIR /app
COPY profiles ./profiles
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels && useradd --system --uid 10001 gateway
USER gateway
EXPOSE 8080
ENTRYPOINT ["gateway"]
CMD ["serve", "--config", "/etc/gateway/gateway.yaml"]
