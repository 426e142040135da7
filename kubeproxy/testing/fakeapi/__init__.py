"""A fake Kubernetes API server, enough to drive a service proxy end to end.

:class:`FakeAPIServer` speaks HTTP/1.1 (or HTTPS) on 127.0.0.1 (stdlib only) the way kube-apiserver
does for the calls a proxy makes: ``/version`` and API discovery; list (with ``limit`` and
``continue``) and watch (one JSON event per line, chunked, ``BOOKMARK`` events when asked
for, an ``ERROR`` 410 event for a compacted ``resourceVersion``, closing after
``timeoutSeconds``) of Services, EndpointSlices, Nodes and ServiceCIDRs; label selectors
(``key``, ``!key``, ``key=value``, ``key!=value``) and the field selectors each resource
supports (``metadata.name=...``, ``spec.clusterIP!=None``, ...); and creating Events.

Tests change the cluster with :meth:`FakeAPIServer.apply` and :meth:`FakeAPIServer.delete`
(which work while the server is stopped too) and misbehave on purpose with
:meth:`~FakeAPIServer.fail_next` (403, 5xx, 410...), :meth:`~FakeAPIServer.drop_watches`,
:meth:`~FakeAPIServer.expire_watches`, :attr:`~FakeAPIServer.delay`,
:meth:`~FakeAPIServer.compact` and :meth:`~FakeAPIServer.stop` /
:meth:`~FakeAPIServer.start` (the same port, the same state). Every request is recorded in
:attr:`~FakeAPIServer.requests` with its verb as RBAC names it, so a test can compare what
a client did with what a ClusterRole allows (:func:`allowed_by`).

Like the real server, lists leave ``kind``/``apiVersion`` out of their items, watch events
carry them, and an EndpointSlice without endpoints or ports has them as ``null``.

One concept per module, the public names re-exported here (``__all__``):

* :mod:`~kubeproxy.testing.fakeapi.server`: :class:`FakeAPIServer`, the tests' controls;
* :mod:`~kubeproxy.testing.fakeapi.store`: the cluster's state (objects, resource
  versions, history) that lists and watches read;
* :mod:`~kubeproxy.testing.fakeapi.faults`: the injected failures and the open watches
  that drops and expiries act on;
* :mod:`~kubeproxy.testing.fakeapi.listener`: the socket, threads and connections (start,
  stop as a killed server);
* :mod:`~kubeproxy.testing.fakeapi.serving`: what each request gets;
  :mod:`~kubeproxy.testing.fakeapi.listwatch`: a list's pages and a watch's stream;
* :mod:`~kubeproxy.testing.fakeapi.resources`: the resources served, by name and kind;
* :mod:`~kubeproxy.testing.fakeapi.requestinfo`: a request as RBAC sees it
  (:class:`APIRequest`, :func:`allowed_by`) and as the server routes it;
* :mod:`~kubeproxy.testing.fakeapi.selectors`: label and field selectors;
* :mod:`~kubeproxy.testing.fakeapi.status`: the ``Status`` bodies of failures;
* :mod:`~kubeproxy.testing.fakeapi.discovery`: ``/version`` and API discovery;
* :mod:`~kubeproxy.testing.fakeapi.watchstream`: a watch's events and their encoding;
* :mod:`~kubeproxy.testing.fakeapi.builders`: objects for tests to apply;
* :mod:`~kubeproxy.testing.fakeapi.tls`: certificates for serving HTTPS (``tls=``), with
  client certificates if wanted.
"""

from kubeproxy.testing.fakeapi.builders import endpoint_slice, node, service, service_cidr
from kubeproxy.testing.fakeapi.requestinfo import APIRequest, allowed_by
from kubeproxy.testing.fakeapi.resources import RESOURCES, ResourceInfo
from kubeproxy.testing.fakeapi.server import FakeAPIServer
from kubeproxy.testing.fakeapi.tls import Certificates, make_certificates

__all__ = [
    "RESOURCES",
    "APIRequest",
    "Certificates",
    "FakeAPIServer",
    "ResourceInfo",
    "allowed_by",
    "endpoint_slice",
    "make_certificates",
    "node",
    "service",
    "service_cidr",
]
