"""An MCP server for tests, run as a process of its own: ``python tests/mcp_server.py http PORT LOG`` (streamable HTTP
on a loopback port) or ``python tests/mcp_server.py stdio LOG``.

Its tools: ``lookup`` (reports progress twice, then answers), ``slow`` (sleeps until cancelled), ``broken`` (fails:
an ``isError`` result), ``huge`` (answers 8 MiB), ``optional`` (an argument that may be left out), ``chatty``
(reports progress ``count`` times, as fast as it can), ``refers_out`` (its schema's ``$ref`` is the environment's
``MCP_TEST_REF_URL``) and ``refers_nowhere`` (its ``$ref`` points at nothing). Each call, each cancellation the server
receives and its own exit are appended to the LOG file, one line each (``cancelled slow``).
"""

from __future__ import annotations

import atexit
import os
import sys

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools import Tool

LOG = sys.argv[-1]


def record(line: str) -> None:
    with open(LOG, "a") as log:
        log.write(line + "\n")


async def referred(a: int) -> str:
    """Declare a schema with a reference."""
    return "referred"


def referring(name: str, ref: str) -> Tool:
    """``referred`` under ``name``, its argument declared as ``ref`` (a schema the SDK would not write itself)."""
    tool = Tool.from_function(referred, name=name)
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
    return tool.model_copy(update={"parameters": schema})


server = MCPServer(
    "test-tools",
    tools=[
        referring("refers_out", os.environ.get("MCP_TEST_REF_URL", "http://127.0.0.1:9/schema")),
        referring("refers_nowhere", "#/$defs/missing"),
    ],
)


@server.tool()
async def lookup(order_id: str, ctx: Context) -> str:
    """Look up an order."""
    record(f"called lookup {order_id}")
    await ctx.report_progress(1, 2, "looking in the warehouse")
    await ctx.report_progress(2, 2)
    return f"order {order_id}: shipped"


@server.tool()
async def slow(seconds: float = 600.0) -> str:
    """Take a long time."""
    record("called slow")
    try:
        await anyio.sleep(seconds)
    except anyio.get_cancelled_exc_class():
        record("cancelled slow")
        raise
    return "slow done"


@server.tool()
async def broken() -> str:
    """Always fails."""
    raise ToolError("the warehouse is closed")


@server.tool()
async def huge() -> str:
    """Answer far too much."""
    return "x" * (8 * 1024 * 1024)


@server.tool()
async def chatty(count: int, ctx: Context) -> str:
    """Report a great deal of progress."""
    for done in range(1, count + 1):
        await ctx.report_progress(done, count, f"step {done}")
    return "chatty done"


@server.tool()
async def optional(city: str, party: int | None = None) -> str:
    """Take an optional argument."""
    return f"{city} for {party}"


if __name__ == "__main__":
    atexit.register(record, f"exited {os.getpid()}")
    if sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
