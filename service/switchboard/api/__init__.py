"""The HTTP/WebSocket control plane: thin routers over the session host and the store."""
