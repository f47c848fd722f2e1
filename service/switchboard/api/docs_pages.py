"""The interactive API docs (``/docs``), served from this origin only.

FastAPI's own pages load Swagger UI (and ReDoc) from a CDN, with no integrity check, on the same origin as the
operator console, whose tabs hold an API key: whoever could change what the CDN serves could read that key. Here
Swagger UI's files come from the installed ``fastapi-offline`` package (its copy of Swagger UI's distribution), the
page's start-up script is a file of ours (no inline script), and the page's policy (``headers.DOCS_CSP``) lets it
load nothing from anywhere else. ``/redoc`` sends readers to ``/docs``.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

DOCS_DIR = Path(__file__).parent / "docs_page"
SWAGGER_UI_DIR = Path(str(files("fastapi_offline") / "static"))  # swagger-ui-bundle.js, swagger-ui.css

router = APIRouter(include_in_schema=False)

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Switchboard API</title>
<link rel="stylesheet" href="/docs/assets/swagger-ui.css">
<link rel="icon" href="/docs/assets/favicon.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/assets/swagger-ui-bundle.js"></script>
<script src="/docs/page/start.js"></script>
</body>
</html>
"""


@router.get("/docs")
async def docs() -> HTMLResponse:
    return HTMLResponse(PAGE)


@router.get("/redoc")
async def redoc() -> RedirectResponse:
    return RedirectResponse("/docs", status_code=308)


def mount(app: FastAPI) -> None:
    """The page, its script and the Swagger UI files."""
    app.include_router(router)
    app.mount("/docs/assets", StaticFiles(directory=SWAGGER_UI_DIR), name="docs-assets")
    app.mount("/docs/page", StaticFiles(directory=DOCS_DIR), name="docs-page")
