"""The OpenAPI document of the public API (and of the admin API when it is on), built
from the pydantic request models."""

from __future__ import annotations

from headroom.admin.api import SORT_KEYS
from headroom.admin.schemas import AbortBody, CapBody, DeprioritizeBody, ReloadBody, TenantPatch
from headroom.app.lora_api import LoadLoraBody, UnloadLoraBody
from headroom.app.responses_schemas import ResponsesRequest
from headroom.app.schemas import ChatCompletionRequest, CompletionRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _errors(*statuses: int) -> dict:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(s): {"description": "error", **ref} for s in statuses}


def _generation(summary: str, schema: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {
                    "description": "a completion (JSON), or a stream of chunks (text/event-stream)",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 404, 409, 413, 429, 503),
            },
        }
    }


def _json(summary: str) -> dict:
    return {"description": summary, "content": {"application/json": {"schema": {"type": "object"}}}}


def _admin_op(
    method: str,
    summary: str,
    body: str | None = None,
    *,
    optional_body: bool = True,
    params: list[dict] | None = None,
    errors: tuple[int, ...] = (),
) -> dict:
    op: dict = {
        "summary": summary,
        "security": [{"adminToken": []}],
        "responses": {"200": _json(summary), **_errors(401, 403, *errors)},
    }
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {
            "required": not optional_body,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
        }
    return {method: op}


def _path_param(name: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _admin_paths() -> dict:
    sid = [_path_param("id")]
    listing = [
        {"name": "sort", "in": "query", "schema": {"type": "string", "enum": list(SORT_KEYS)}},
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 10000}},
    ]
    return {
        "/admin/sequences": _admin_op("get", "Live sequences by cost", params=listing, errors=(400,)),
        "/admin/sequences/{id}": _admin_op("get", "One live sequence", params=sid, errors=(404,)),
        "/admin/sequences/{id}/abort": _admin_op(
            "post", "Abort a sequence", "AbortBody", params=sid, errors=(404, 409, 422)
        ),
        "/admin/sequences/{id}/deprioritize": _admin_op(
            "post", "Deprioritize a sequence", "DeprioritizeBody", params=sid, errors=(404, 409, 422)
        ),
        "/admin/sequences/{id}/cap": _admin_op(
            "post", "Cap a sequence's output", "CapBody", params=sid, optional_body=False, errors=(404, 409, 422)
        ),
        "/admin/tenants": _admin_op("get", "Tenants and their live limits"),
        "/admin/tenants/{name}": _admin_op(
            "patch",
            "Change a tenant's limits",
            "TenantPatch",
            params=[_path_param("name")],
            optional_body=False,
            errors=(404, 422),
        ),
        "/admin/predictor/reload": _admin_op("post", "Reload the length predictor", "ReloadBody", errors=(409, 422)),
        "/admin/stats": _admin_op("get", "Occupancy, latency windows, head-of-line signal"),
    }


def _lora_paths() -> dict:
    """vLLM's run-time adapter routes: always served, always behind the admin token."""

    def op(summary: str, body: str, errors: tuple[int, ...]) -> dict:
        return {
            "post": {
                "summary": summary,
                "security": [{"adminToken": []}],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}},
                },
                "responses": {
                    "200": {"description": summary, "content": {"text/plain": {"schema": {"type": "string"}}}},
                    **_errors(400, 401, *errors),
                },
            }
        }

    return {
        "/v1/load_lora_adapter": op("Load a LoRA adapter (PEFT folder)", "LoadLoraBody", ()),
        "/v1/unload_lora_adapter": op("Unload a LoRA adapter", "UnloadLoraBody", (404, 409)),
    }


def build_openapi(version: str, admin: bool = False, unknown_fields: str = "reject") -> dict:
    """unknown_fields: [server] unknown_fields, which says whether a request body may hold
    fields beyond those its model declares (app/fields.py)."""
    schemas: dict = {"Error": _ERROR}
    generation = [CompletionRequest, ChatCompletionRequest, ResponsesRequest]
    admin_bodies = [AbortBody, DeprioritizeBody, CapBody, TenantPatch, ReloadBody]
    models = generation + [LoadLoraBody, UnloadLoraBody] + (admin_bodies if admin else [])
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    for model in generation:
        schemas[model.__name__]["additionalProperties"] = unknown_fields == "accept"
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "headroom", "version": version, "description": "OpenAI-compatible LLM inference API"},
        "paths": {
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            "/v1/responses": _generation("Response (OpenAI's Responses API, stateless)", "ResponsesRequest"),
            "/v1/models": {
                "get": {
                    "summary": "Served models",
                    "responses": {
                        "200": {
                            "description": "model list",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "Liveness: 200 while serving, 503 while draining",
                    "responses": {"200": {"description": "serving"}, **_errors(503)},
                }
            },
        },
        "components": {"schemas": schemas, "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}}},
    }
    spec["paths"].update(_lora_paths())
    if admin:
        spec["paths"].update(_admin_paths())
    return spec
