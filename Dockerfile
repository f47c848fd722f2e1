FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY migrations ./migrations
RUN pip install --no-cache-dir ".[server]" \
    && useradd --system --uid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin switchboard \
    && mkdir -p /app/var \
    && chown switchboard:switchboard /app/var
# the code stays root-owned and read-only to the service; only its SQLite directory is writable
USER 10001:10001
ENV SWITCHBOARD_HOST=0.0.0.0 SWITCHBOARD_PORT=8080
EXPOSE 8080
CMD ["switchboard", "serve"]
