"""The ``Status`` objects the real API server answers failures with.

Apart from the server: one body shape and the reason each HTTP code carries, shared by
every answer that fails (and by a watch's ``ERROR`` events).
"""

from __future__ import annotations

from kubeproxy.testing.fakeapi.resources import JSONObject

__all__ = ["REASONS", "status"]


REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "AlreadyExists",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def status(code: int, message: str, reason: str | None = None) -> JSONObject:
    """A failure's ``Status`` body (``reason`` defaults to the code's own)."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, ""),
        "code": code,
    }
