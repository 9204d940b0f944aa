"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: vLLM's bodies and answers, served only with
`lora.runtime_loading` (off by default). With API keys configured they take an admin key (`server.admin_api_keys`):
a tenant's key may use adapters, not change what the server runs.

A load reads and checks the adapter off the event loop (engine/lora/adapter.py), so a bad one is a 400 naming the
reason and the server serves on; an unload stops new requests at once (404 for its name) while those already
admitted finish on it (engine/lora/registry.py).
"""

from __future__ import annotations

import asyncio
import hmac

import msgspec
from litestar import Request, Response, post

from ..engine.lora.adapter import AdapterError, LoraModule
from ..settings import Settings
from .errors import APIError, check_limits, decode_body, invalid_request
from ..limits import LORA

TEXT = "text/plain; charset=utf-8"


class LoadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str


_load_decoder = msgspec.json.Decoder(LoadLoRAAdapterRequest)
_unload_decoder = msgspec.json.Decoder(UnloadLoRAAdapterRequest)


def _adapters(request: Request):
    """The registry of the ready server (503 while it loads)."""
    state = request.app.state.server
    state.require_ready()
    _require_admin(state.settings, request)
    return state, state.engine.adapters


def _require_admin(settings: Settings, request: Request) -> None:
    server = settings.server
    if not (server.api_keys or server.admin_api_keys):
        return
    given = request.headers.get("authorization", "").partition(" ")[2].strip().encode()
    if not any([hmac.compare_digest(given, key.encode()) for key in server.admin_api_keys]):
        raise APIError(403, "Loading and unloading LoRA adapters needs an admin API key (--admin-api-key).",
                       "invalid_request_error", None, "permission_denied")


@post("/v1/load_lora_adapter", status_code=200)
async def load_lora_adapter(request: Request) -> Response:
    state, adapters = _adapters(request)
    body: LoadLoRAAdapterRequest = decode_body(_load_decoder, await request.body())
    name, path = body.lora_name.strip(), body.lora_path.strip()
    for param, value in (("lora_name", name), ("lora_path", path)):
        check_limits(param, LORA, value)
    if name == state.served_name or adapters.lookup(name) is not None:
        raise invalid_request(f"The lora adapter '{name}' has already been loaded.", "lora_name", "lora_adapter_exists")
    try:
        registration = await asyncio.to_thread(adapters.read, LoraModule(name, path))
        adapters.register(registration)
    except AdapterError as exc:
        raise invalid_request(str(exc), "lora_path", "invalid_lora_adapter") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type=TEXT)


@post("/v1/unload_lora_adapter", status_code=200)
async def unload_lora_adapter(request: Request) -> Response:
    _, adapters = _adapters(request)
    body: UnloadLoRAAdapterRequest = decode_body(_unload_decoder, await request.body())
    try:
        adapters.unregister(body.lora_name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "invalid_request_error", "lora_name",
                       "lora_adapter_not_found") from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type=TEXT)


def lora_routes(settings: Settings) -> list:
    """The endpoints, when `lora.runtime_loading` allows them (else they are not there: 404)."""
    return [load_lora_adapter, unload_lora_adapter] if settings.lora.runtime_loading else []
