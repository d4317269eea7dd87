# The service's image. A first stage compiles the wheel (the exact partial states in C,
# service/domain/_partial.c); the image itself installs that wheel, with no compiler.
FROM python:3.11-slim AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY client client
COPY integrations integrations
COPY service service
COPY migrations migrations
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
WORKDIR /app
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/steptally-*.whl)[service]" && rm -rf /wheels
EXPOSE 8000
CMD ["steptally", "serve", "--host", "0.0.0.0", "--port", "8000"]
