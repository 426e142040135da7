"""kubeproxy.testing: prove a backend with real packets, from flow-case files.

A flow case (format: ``flowcases/FORMAT.md``; examples: ``flowcases/examples/``) lists
Services and EndpointSlices and, after each sync, where new connections must end up: a
set of endpoints (every one reached, nothing else), ``DROP``, ``REJECT``, or untouched,
with or without masquerade and session affinity. The kit builds the scene in network
namespaces it creates (the standard test node with a pod bridge, one namespace per
endpoint and per pod client, an outside network with external clients and a catch-all
listener), feeds the objects through the core (:class:`kubeproxy.proxier.Proxier`) into
your backend running for the node namespace, syncs, sends the traffic and judges it. It
removes everything it created, also on failure, Ctrl-C and SIGTERM. It needs root.

Your backend plugs in through its :class:`~kubeproxy.backend.BackendFactory`:
``factory(family, config, *, netns=NAME) -> Backend``, where ``netns`` is the node
namespace (as ``ip netns`` names it) the backend must program.

From the command line::

    python -m kubeproxy.testing.flowcases --backend nftables flowcases/examples/*.yaml
    python -m kubeproxy.testing.flowcases --backend my_proxy.backend:factory my-cases.yaml

``--backend`` takes a name registered in the ``kubeproxy.backends`` entry-point group
(``[project.entry-points."kubeproxy.backends"] mine = "my_proxy.backend:factory"``) or a
``module:attribute``. It prints one line per flow (``PASS``/``FAIL``/``SKIP``, the flow
id, what was seen) and ``N passed, N failed, N skipped``; the exit status is 0 only when
nothing failed. ``--timeout`` sets how long an attempt waits (what a DROP costs, 1 s).

From pytest, one test per flow::

    import pytest
    from kubeproxy.testing.pytest import flow_test
    from my_proxy.backend import factory

    test_flows = flow_test(
        ["flowcases/examples/*.yaml", "tests/my-cases/*.yaml"],
        backend=factory,              # or "my_proxy.backend:factory", or "nftables"
        marks=[pytest.mark.kernel],   # optional
    )

Relative paths are taken from the current directory unless ``base=`` says otherwise.

A proxy that is not a backend in this process (a binary, a container image, another
implementation) is checked the same way with :func:`drive_case` and a
:class:`ProxyDriver`: called with the case and its built scene, it starts the proxy for
the node namespace and yields a :class:`CaseHandler` that hands the proxy each step's
objects (a :class:`~kubeproxy.testing.fakeapi.FakeAPIServer` serving them, say) and whose
``sync_now`` returns once the proxy applied them; the kit sends the traffic and judges it
as for a backend. ``tests/test_image_run.py`` runs the DaemonSet's image this way.
The first test of a case runs the whole case; the others read its results, so a file of
about twenty flows takes a few seconds. For other uses, :func:`run_file` and
:func:`run_case` return :class:`FlowResult` objects, and :func:`load_case_file` parses a
file (unknown keys and actions become warnings, never errors).

Verdicts: a flow passes only when packets showed it. It fails when the sync fails
(``sync_now()`` returned False), when the factory raised, or when the kernel did
something else; it is skipped when this machine cannot check it: SCTP flows (this kernel
has no SCTP sockets), and every flow of a case whose factory raised an error saying
``kernel lacks ...`` (an ipvs backend without IP_VS, say).

Notes: namespaces are named ``kpxf-<run id>-...``; the node's pod bridge is ``kpxfbr0``
and pod veths on the node start with ``kpxfpod`` (for the BridgeInterface and
InterfaceNamePrefix local-traffic detectors); the node's default route leads to a
namespace that answers any address, so traffic the proxy leaves alone is seen arriving
and only a real drop stays silent. ``family: DualStack`` (our extension) runs an IPv4 and
an IPv6 proxier together. While a case runs in the main thread, SIGTERM (if it still has
its default action) unwinds like Ctrl-C, so the namespaces are removed.
"""

from kubeproxy.testing.cases import (
    Case,
    CaseFile,
    CaseFormatError,
    Flow,
    FlowCaseWarning,
    load_case_file,
    parse_case_file,
)
from kubeproxy.testing.node import STANDARD_NODE
from kubeproxy.testing.runner import (
    BackendNotFound,
    CaseHandler,
    FlowResult,
    ProxyDriver,
    RunOptions,
    Status,
    drive_case,
    resolve_backend,
    run_case,
    run_file,
    run_files,
)

__all__ = [
    "STANDARD_NODE",
    "BackendNotFound",
    "Case",
    "CaseFile",
    "CaseFormatError",
    "CaseHandler",
    "Flow",
    "FlowCaseWarning",
    "FlowResult",
    "ProxyDriver",
    "RunOptions",
    "Status",
    "drive_case",
    "load_case_file",
    "parse_case_file",
    "resolve_backend",
    "run_case",
    "run_file",
    "run_files",
]
