"""Where agents, tools and models come from besides Python code: the built-in demo agent, agents files with webhook
tools (and the JSON Schema subset their parameters use), and the server's model profiles."""
