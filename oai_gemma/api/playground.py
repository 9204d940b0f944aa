"""The web playground: one static page (HTML, CSS, JavaScript modules shipped in the package, no build step,
nothing fetched from elsewhere) that talks to this server's own `/v1/chat/completions`.

The page and its files are open without an API key, so a browser can load it; every API call the page makes
sends the key the user typed (kept in the browser's local storage), as any client must.
"""

from __future__ import annotations

from pathlib import Path

from litestar import Response, get
from litestar.exceptions import NotFoundException

from ..settings import Settings

STATIC = Path(__file__).parent / "static" / "playground"
MEDIA_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}  # Litestar adds the utf-8 charset to text/
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    # the page runs only its own scripts and talks only to this server, whatever a model answer contains
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}
FILES = {path.name: path for path in STATIC.iterdir() if path.suffix in MEDIA_TYPES}


def _file(name: str) -> Response:
    path = FILES.get(name)
    if path is None:
        raise NotFoundException()
    return Response(content=path.read_bytes(), media_type=MEDIA_TYPES[path.suffix], headers=HEADERS)


@get(["/", "/playground"], include_in_schema=False)
async def page() -> Response:
    return _file("index.html")


@get("/playground/{name:str}", include_in_schema=False)
async def asset(name: str) -> Response:
    return _file(name)


@get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    """What a browser asks for on every page of this server: the playground's icon (an SVG, which browsers take)."""
    return _file("favicon.svg")


def playground_routes(settings: Settings) -> list:
    """The page's routes, none when `server.playground` is off (then `/` is a 404 like any unknown path)."""
    return [page, asset, favicon] if settings.server.playground else []


def playground_paths(settings: Settings) -> frozenset[str]:
    """The paths served without an API key: the page and its files (not the API it calls)."""
    if not settings.server.playground:
        return frozenset()
    return frozenset({"/", "/playground", "/favicon.ico", *(f"/playground/{name}" for name in FILES)})
