"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`: vLLM's bodies and answers, served only with
`lora.runtime_loading` (off by default). With API keys configured they take an admin key (`server.admin_api_keys`):
a tenant's key may use adapters, not change what the server runs.

A load reads and checks the adapter on a worker thread (engine/lora/adapter.py), neither the event loop nor the
engine thread, so a bad one is a 400 naming the reason and every stream goes on; then, like an unload, it is a
message through the engine's inbox, which the route awaits (engine/core.py): the engine thread alone changes the
adapters (engine/lora/registry.py). An unload stops new requests at once (404 for its name) while those already
admitted or waiting finish on it.
"""

from __future__ import annotations

import hmac

import msgspec
from litestar import Request, Response, post

from ..engine.lora.adapter import AdapterError, LoraModule
from ..engine.lora.registry import NameTaken
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


def _server(request: Request):
    """The ready server's state (503 while it loads), for an admin."""
    state = request.app.state.server
    state.require_ready()
    require_admin(state.settings, request, "Loading and unloading LoRA adapters")
    return state


def require_admin(settings: Settings, request: Request, what: str) -> None:
    """With API keys configured, a 403 unless the request carries an admin key (`server.admin_api_keys`)."""
    server = settings.server
    if not (server.api_keys or server.admin_api_keys):
        return
    given = request.headers.get("authorization", "").partition(" ")[2].strip().encode()
    if not any([hmac.compare_digest(given, key.encode()) for key in server.admin_api_keys]):
        raise APIError(403, f"{what} needs an admin API key (--admin-api-key).",
                       "invalid_request_error", None, "permission_denied")


@post("/v1/load_lora_adapter", status_code=200)
async def load_lora_adapter(request: Request) -> Response:
    state = _server(request)
    body: LoadLoRAAdapterRequest = decode_body(_load_decoder, await request.body())
    name, path = body.lora_name.strip(), body.lora_path.strip()
    for param, value in (("lora_name", name), ("lora_path", path)):
        check_limits(param, LORA, value)
    exists = invalid_request(f"The lora adapter '{name}' has already been loaded.", "lora_name", "lora_adapter_exists")
    if name == state.served_name or state.engine.adapters.lookup(name) is not None:
        raise exists
    try:
        await state.engine.load_adapter(LoraModule(name, path))
    except NameTaken:  # by another load while the files were read
        raise exists from None
    except AdapterError as exc:
        raise invalid_request(str(exc), "lora_path", "invalid_lora_adapter") from None
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type=TEXT)


@post("/v1/unload_lora_adapter", status_code=200)
async def unload_lora_adapter(request: Request) -> Response:
    state = _server(request)
    body: UnloadLoRAAdapterRequest = decode_body(_unload_decoder, await request.body())
    try:
        await state.engine.unload_adapter(body.lora_name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "invalid_request_error", "lora_name",
                       "lora_adapter_not_found") from None
    return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type=TEXT)


def lora_routes(settings: Settings) -> list:
    """The endpoints, when `lora.runtime_loading` allows them (else they are not there: 404)."""
    return [load_lora_adapter, unload_lora_adapter] if settings.lora.runtime_loading else []
