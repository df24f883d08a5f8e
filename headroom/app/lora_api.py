"""vLLM's routes for LoRA adapters at run time: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, with vLLM's bodies and plain-text success replies. The admin
token guards both (app/auth.py). An unload is refused (409) while sequences run under the
adapter: they finish first, and a request still waiting in admission for it fails when it
reaches the engine."""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from headroom.app import keys
from headroom.app.errors import BadRequest, Conflict, NotFound
from headroom.app.fields import parse_body
from headroom.models.lora import LoraError, LoraInUse

log = logging.getLogger(__name__)


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # vLLM's: replace an adapter loaded under the same name. Not done here: unload it first.
    load_inplace: bool = False


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, LoadLoraBody, "Unrecognized request argument supplied: {}")
    if body.load_inplace:
        raise BadRequest(
            "load_inplace is not supported: unload the adapter, then load it again",
            param="load_inplace",
            code="unsupported_parameter",
        )
    try:
        await request.app[keys.ENGINE].load_lora(body.lora_name, body.lora_path)
    except LoraError as exc:
        raise BadRequest(str(exc), param="lora_path", code="invalid_lora_adapter") from None
    log.info("LoRA adapter %s loaded from %s", body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await parse_body(request, UnloadLoraBody, "Unrecognized request argument supplied: {}")
    try:
        await request.app[keys.ENGINE].unload_lora(body.lora_name)
    except LoraInUse as exc:
        raise Conflict(str(exc), param="lora_name", code="lora_adapter_in_use") from None
    except KeyError:
        raise NotFound(
            f"The LoRA adapter '{body.lora_name}' is not loaded.", param="lora_name", code="lora_adapter_not_found"
        ) from None
    log.info("LoRA adapter %s unloaded", body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
