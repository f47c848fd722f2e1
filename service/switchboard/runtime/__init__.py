"""The live-session runtime: pure asyncio + pydantic, no HTTP and no database."""
