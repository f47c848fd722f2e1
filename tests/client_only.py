"""The ``switchboard`` command as ``pip install switchboard`` (the client alone) has it: the server's packages cannot
be imported."""

# ``python -c WITHOUT_SERVER ARGS...`` runs ``switchboard ARGS...`` with a finder that refuses the server's packages
WITHOUT_SERVER = """
import sys
SERVER = {"fastapi", "starlette", "sqlalchemy", "uvicorn", "openai", "opentelemetry", "alembic", "redis",
          "prometheus_client", "pydantic_settings", "asyncpg", "aiosqlite"}
class NoServer:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in SERVER:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoServer())
from switchboard.cli.main import main
sys.exit(main(sys.argv[1:]))
"""
