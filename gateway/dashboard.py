"""The live dashboard page, its static files, and recent requests' KV provenance over HTTP.

    GET /dashboard                  the page; it polls ``stats`` and ``v1/requests`` (relative
                                    URLs, so it works under any route prefix) every 1.5 s and
                                    computes rates from successive readings itself
    GET /dashboard/static/{name}    its script and style, and uPlot (MIT, vendored from the npm
                                    registry with its licence: clusters often have no internet)
    GET /v1/requests?limit=N        the newest N finished requests' provenance, newest first
    GET /v1/requests/{request_id}   one request's provenance; 404 once it left the store

The page and its files ship in the package (``static/``); nothing is loaded from elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

from pdserve.gateway.api.openai_schema import APIError
from pdserve.gateway.request_provenance import RecentRequests

STATIC_DIR = Path(__file__).parent / "static"
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# Only the files shipped beside this module are served: a name is looked up, never joined.
_STATIC_FILES = {path.name: path for path in STATIC_DIR.iterdir() if path.is_file()}
DEFAULT_LIMIT = 50

dashboard_router = APIRouter()


@dashboard_router.get("/dashboard")
async def dashboard_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")


@dashboard_router.get("/dashboard/static/{name}")
async def dashboard_file(name: str) -> Response:
    path = _STATIC_FILES.get(name)
    if path is None:
        error = APIError(404, f"the dashboard has no file {name!r}", code="not_found")
        return JSONResponse(error.body(), status_code=404)
    return FileResponse(path, media_type=_MEDIA_TYPES.get(path.suffix, "text/plain"))


def recent_requests_body(
    recent: RecentRequests, limit: int, shared: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``GET /v1/requests``: up to ``limit`` records, newest first, as an OpenAI-style list
    (``shared``: every gateway replica's, from their board, instead of this one's)."""
    data = shared if shared is not None else [record.to_json() for record in recent.latest(limit)]
    return {"object": "list", "capacity": recent.capacity, "data": data}


def request_provenance_response(
    recent: RecentRequests, request_id: str, shared: dict[str, Any] | None = None
) -> JSONResponse:
    """``GET /v1/requests/{id}``: the record (``shared``: another gateway replica's, from
    their board), or 404 naming how many requests are kept."""
    if shared is not None:
        return JSONResponse(shared)
    record = recent.get(request_id)
    if record is None:
        error = APIError(
            404,
            f"no finished request {request_id!r} among the last "
            f"{recent.capacity} this gateway keeps",
            param="request_id",
            code="not_found",
        )
        return JSONResponse(error.body(), status_code=404)
    return JSONResponse(record.to_json())
