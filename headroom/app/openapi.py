"""The OpenAPI document of the public API, built from the pydantic request models."""

from __future__ import annotations

from headroom.app.schemas import ChatCompletionRequest, CompletionRequest

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}


def _errors(*statuses: int) -> dict:
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {str(s): {"description": "error", **ref} for s in statuses}


def _generation(summary: str, schema: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": "a completion (JSON), or a stream of chunks (text/event-stream)",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 404, 409, 413, 429, 503),
        },
    }}


def build_openapi(version: str) -> dict:
    schemas: dict = {"Error": _ERROR}
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return {
        "openapi": "3.1.0",
        "info": {"title": "headroom", "version": version,
                 "description": "OpenAI-compatible LLM inference API"},
        "paths": {
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            "/v1/models": {"get": {"summary": "Served models",
                                   "responses": {"200": {"description": "model list",
                                                         "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/health": {"get": {"summary": "Liveness: 200 while serving, 503 while draining",
                                "responses": {"200": {"description": "serving"}, **_errors(503)}}},
        },
        "components": {"schemas": schemas},
    }
