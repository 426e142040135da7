"""The API client: built as upstream builds it, and the plain GET the source makes with it.

:func:`make_api_client` builds a ``kubernetes.client.ApiClient`` from ``--kubeconfig``,
``--master`` or the in-cluster service account, with client-side rate limiting
(``--kube-api-qps``/``--kube-api-burst``, :class:`~kubeproxy.sources.kubernetes.ratelimit.
TokenBucket`) the Python client does not have. :func:`get` is the one request the
reflectors and the API discovery make through it, and :func:`describe_error` the one log
line any of its failures becomes. Apart from the reflectors: this is the only module that
knows how the official client is configured and called.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import urllib3
from kubernetes import client, config

from kubeproxy.sources.kubernetes.ratelimit import TokenBucket

__all__ = [
    "IN_CLUSTER_MESSAGE",
    "RateLimitedApiClient",
    "describe_error",
    "get",
    "make_api_client",
]

# The whole Kubernetes source logs under one name, as it did when it was one module:
# operators and tests filter on it.
logger = logging.getLogger("kubeproxy.sources.kubernetes")

IN_CLUSTER_MESSAGE = (
    "Neither kubeconfig file nor master URL was specified, falling back to in-cluster config"
)
"""Upstream's log line when neither ``--kubeconfig`` nor ``--master`` is given."""

_JSON = "application/json"
_PROTOBUF = "application/vnd.kubernetes.protobuf"


class RateLimitedApiClient(client.ApiClient):
    """An ``ApiClient`` whose every request first takes a token from a :class:`TokenBucket`."""

    def __init__(self, configuration: client.Configuration, bucket: TokenBucket) -> None:
        super().__init__(configuration)
        self.bucket = bucket

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        """Wait for the rate limit, then make the request."""
        self.bucket.acquire()
        return super().call_api(*args, **kwargs)

    def call_api_unthrottled(self, *args: Any, **kwargs: Any) -> Any:
        """Make the request at once: a further page of a list already let through."""
        return super().call_api(*args, **kwargs)


def make_api_client(
    kubeconfig: str | None,
    master: str | None,
    *,
    qps: float = 5.0,
    burst: int = 10,
    content_type: str = _PROTOBUF,
) -> RateLimitedApiClient:
    """An API client as upstream builds it from ``--kubeconfig`` and ``--master``.

    A kubeconfig file if given (``master``, if also given, overrides its server), else
    ``master`` alone (no credentials), else the in-cluster service account (logging
    upstream's :data:`IN_CLUSTER_MESSAGE`). ``content_type`` is ``application/json`` or
    upstream's default protobuf, which the Python client cannot speak: JSON is used then.
    Raises ``kubernetes.config.ConfigException`` when the configuration cannot be loaded
    (naming the kubeconfig file, and saying so when it cannot be read at all) and
    :class:`ValueError` for an unknown content type.
    """
    if content_type not in (_JSON, _PROTOBUF):
        raise ValueError(
            f"unsupported API content type {content_type!r}: use {_JSON} or {_PROTOBUF}"
        )
    if content_type == _PROTOBUF:
        logger.debug("The Python Kubernetes client has no protobuf codec; using %s", _JSON)
    configuration = client.Configuration()
    if kubeconfig:
        try:
            with open(kubeconfig, "rb"):
                pass
        except OSError as err:
            # The client would say only "Invalid kube-config file. No configuration found."
            raise config.ConfigException(
                f"cannot read the kubeconfig file {kubeconfig}: {err.strerror or err}"
            ) from None
        try:
            # persist_config=False: a token refresh must not rewrite the operator's file.
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration, persist_config=False
            )
        except config.ConfigException as err:
            if kubeconfig in str(err):
                raise
            raise config.ConfigException(f"kubeconfig file {kubeconfig}: {err}") from None
        if master:
            configuration.host = master
            refresh = configuration.refresh_api_key_hook
            if refresh is not None:
                # The kubeconfig loader's token refresh hook, run before every request,
                # writes the file's server back into the configuration.
                def refresh_keeping_master(cfg: Any, _refresh: Any = refresh) -> None:
                    _refresh(cfg)
                    cfg.host = master

                configuration.refresh_api_key_hook = refresh_keeping_master
    elif master:
        configuration.host = master
    else:
        logger.warning(IN_CLUSTER_MESSAGE)
        config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    # urllib3 would retry a refused connection three times, logging a warning each time;
    # the reflectors retry with backoff and log one line themselves.
    configuration.retries = False
    api = RateLimitedApiClient(configuration, TokenBucket(qps, burst))
    api.user_agent = "kube-proxy/kubeproxy (python)"
    return api


def describe_error(err: BaseException) -> str:
    """One log line for a failed request: the status and the server's message, or what
    became of the connection."""
    if isinstance(err, client.ApiException):
        reason = ""
        try:
            body = json.loads(err.body) if err.body else {}
            reason = body.get("message", "") if isinstance(body, dict) else ""
        except ValueError:
            reason = str(err.body)[:200]
        text = f"{err.status} {err.reason}"
        return f"{text}: {reason}" if reason else text
    if isinstance(err, urllib3.exceptions.MaxRetryError) and err.reason is not None:
        return describe_error(err.reason)
    if isinstance(err, urllib3.exceptions.NewConnectionError):
        cause = err.__cause__ or err.__context__
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else None
        return f"cannot reach the API server ({why or str(err).rsplit(': ', 1)[-1]})"
    if isinstance(err, urllib3.exceptions.ConnectTimeoutError):
        return "cannot reach the API server (connect timeout)"
    if isinstance(err, urllib3.exceptions.ReadTimeoutError):
        return "the API server did not answer in time"
    if isinstance(err, urllib3.exceptions.ProtocolError):
        cause = err.args[1] if len(err.args) > 1 else None
        return f"connection lost ({cause or err})"
    text = str(err) or type(err).__name__
    return " ".join(f"{type(err).__name__}: {text}".split())


def get(
    api: client.ApiClient,
    path: str,
    query: Sequence[tuple[str, str]],
    timeout: tuple[float, float],
    *,
    throttle: bool = True,
) -> Any:
    """GET through the official client's transport, auth and rate limit (unless not
    ``throttle``: the next page of a list); the urllib3 response, unread. Raises
    ``ApiException`` for a non-2xx status.

    The generated API classes are skipped on purpose: constructing ``CoreV1Api`` alone
    builds its pydantic models for seconds, a cost every proxy start would pay.
    """
    method, url, headers, body, post_params = api.param_serialize(
        method="GET",
        resource_path=path,
        query_params=list(query),
        header_params={"Accept": _JSON},
        auth_settings=["BearerToken"],
    )
    call = api.call_api
    if not throttle and isinstance(api, RateLimitedApiClient):
        call = api.call_api_unthrottled
    response: Any = call(method, url, headers, body, post_params, _request_timeout=timeout)
    if not 200 <= response.status <= 299:
        response.read()
        raise client.ApiException.from_response(http_resp=response, body=None, data=None)
    return response.response
