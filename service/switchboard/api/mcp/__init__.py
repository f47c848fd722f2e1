"""The control plane as an MCP server (``/mcp``): each tool is a REST operation, made with the caller's credential."""
