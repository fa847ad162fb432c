"""Refusals in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status OpenAI's API uses, so every OpenAI client raises its usual exception class."""

from __future__ import annotations

from starlette.responses import JSONResponse

INVALID = "invalid_request_error"  # 400, 401, 404, 413: the request is at fault


class APIError(Exception):
    """A refused request: the status, OpenAI's error fields and any extra headers (Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
