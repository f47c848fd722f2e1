FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY migrations ./migrations
RUN pip install --no-cache-dir .
ENV SWITCHBOARD_HOST=0.0.0.0 SWITCHBOARD_PORT=8080
EXPOSE 8080
CMD ["switchboard", "serve"]
