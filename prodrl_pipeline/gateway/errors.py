"""OpenAI-shaped error bodies, and request validation errors worded as OpenAI words them."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _field_path(loc: tuple) -> str | None:
    """The request field of a validation error's location: "body" and pydantic's union-member
    tags (`str`, `list[TextPart]`, `NamedToolChoice`, ...) dropped."""
    parts = [
        str(x)
        for x in loc[1:]
        if isinstance(x, int) or not (x in _TYPE_TAGS or x[:1].isupper() or any(c in x for c in "[-'"))
    ]
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> JSONResponse:
    """The most specific validation error as OpenAI words it: 400, the field in `param`."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(400, "We could not parse the JSON body of your request.")
    e = max(errors, key=lambda e: len(e.get("loc", ())), default={})
    param = _field_path(tuple(e.get("loc", ())))
    if e.get("type") == "extra_forbidden":
        return error_response(400, f"Unrecognized request argument supplied: {param}", param)
    if e.get("type") == "missing":
        return error_response(400, f"Missing required parameter: {param}", param)
    message = str(e.get("msg", "invalid request")).removeprefix("Value error, ")
    return error_response(400, f"Invalid value for {param}: {message}" if param else message, param)
