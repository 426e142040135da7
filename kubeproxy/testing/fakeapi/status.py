"""The ``Status`` objects the real API server answers failures with.

Apart from the server: one body shape and the reason each HTTP code carries, shared by
every answer that fails (and by a watch's ``ERROR`` events).
"""

from __future__ import annotations

from kubeproxy.testing.fakeapi.requestinfo import Route
from kubeproxy.testing.fakeapi.resources import JSONObject

__all__ = ["REASONS", "failure_status", "status"]


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


def failure_status(code: int, route: Route) -> JSONObject:
    """The body of a failure a test injected, as the real server words that failure."""
    assert route.info is not None
    info = route.info
    if code == 403:
        scope = (
            f'in the namespace "{route.namespace}"' if route.namespace else "at the cluster scope"
        )
        user = "system:serviceaccount:kube-system:kube-proxy"
        return status(
            403,
            f'{info.resource} is forbidden: User "{user}" cannot {route.verb} resource '
            f'"{info.resource}" in API group "{info.group}" {scope}',
        )
    if code == 410:
        return status(410, "The provided continue parameter is too old", "Expired")
    if code == 429:
        return status(429, "Too many requests, please try again later.")
    return status(code, f"fake failure injected for {route.verb} {info.resource}")
