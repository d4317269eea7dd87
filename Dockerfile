FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY client client
COPY service service
COPY migrations migrations
RUN pip install --no-cache-dir '.[service]'
EXPOSE 8000
CMD ["steptally", "serve", "--host", "0.0.0.0", "--port", "8000"]
