"""Run flow cases against a backend: scene, core, backend, packets, verdicts.

For each case the runner builds the scene (:mod:`kubeproxy.testing.scene`), creates the
backend(s) for the node namespace through their factory, and feeds every step's objects
through the core (:class:`kubeproxy.proxier.Proxier`, or a
:class:`~kubeproxy.proxier.DualStackProxier` for ``family: DualStack``). At each sync
step it syncs, then probes every flow of the step in parallel and judges it
(:mod:`kubeproxy.testing.traffic`). Everything it created is removed when the case ends,
whatever happened.

A flow FAILs when the sync fails, when the backend cannot be created, or when the
packets do something else than the flow says; it is SKIPped when it needs what this
machine lacks (SCTP sockets, or a backend whose factory raises an error saying
``kernel lacks ...``); it never passes without packets having shown it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import FrameType
from typing import Any, Final, Protocol, cast

from kubeproxy.backend import Backend, BackendFactory
from kubeproxy.entrypoints import BACKEND_GROUP, BackendNotFound, load_backend
from kubeproxy.objects import IPAddress, NamespacedName
from kubeproxy.objects import Protocol as L4Protocol
from kubeproxy.testing.cases import Case, CaseFile, Flow, Step, StepAction, load_case_file
from kubeproxy.testing.node import STANDARD_NODE, StandardNode
from kubeproxy.testing.scene import Scene, SceneError, plan_scene
from kubeproxy.testing.traffic import ClientPorts, Prober, Verdict, judge, probe_flow

__all__ = [
    "BACKEND_GROUP",
    "KERNEL_LACKS",
    "TIMEOUT_SCALE_VARIABLE",
    "BackendNotFound",
    "CaseHandler",
    "FlowResult",
    "ProxyDriver",
    "RunOptions",
    "Status",
    "default_timeout",
    "drive_case",
    "flow_id",
    "replay_syncs",
    "resolve_backend",
    "run_case",
    "run_file",
    "run_files",
    "sctp_skip_reason",
]

logger = logging.getLogger(__name__)

"""The entry-point group backends register their factory under."""
KERNEL_LACKS: Final = "kernel lacks"
"""A factory error containing this (``kernel lacks IP_VS``) skips the case's flows."""
TIMEOUT_SCALE_VARIABLE: Final = "KUBEPROXY_FLOW_TIMEOUT_SCALE"
"""Multiplies the default attempt timeout (1 s) on slow machines, e.g. emulated VMs."""


def default_timeout() -> float:
    """1 s per attempt, times :data:`TIMEOUT_SCALE_VARIABLE` when that is set.

    An answer takes well under a millisecond in a namespace on real hardware; under CPU
    emulation (QEMU without KVM) a step's hundreds of parallel connections took more than
    1 s to be answered (``make test-kernels``: docs/kernels-and-images.md, "Kernels tested").
    """
    text = os.environ.get(TIMEOUT_SCALE_VARIABLE, "").strip()
    if not text:
        return 1.0
    try:
        scale = float(text)
    except ValueError:
        raise ValueError(f"{TIMEOUT_SCALE_VARIABLE}={text!r} is not a number") from None
    if not 0 < scale <= 100:
        raise ValueError(f"{TIMEOUT_SCALE_VARIABLE}={text!r}: want a number in (0, 100]")
    return scale


class Status(StrEnum):
    """A flow's result."""

    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True, slots=True)
class FlowResult:
    """The result of one flow: ``id`` is ``<test>/<case>/sync<N>/<flow name>``."""

    id: str
    flow: Flow
    status: Status
    detail: str

    def line(self) -> str:
        """The one-line report: ``PASS <id>: <what was seen>``."""
        return f"{self.status.value} {self.id}: {self.detail}"


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Knobs of a run.

    ``timeout`` is how long an attempt waits for an answer (what a DROP costs; by
    default 1 s, scaled by ``KUBEPROXY_FLOW_TIMEOUT_SCALE``);
    ``run_id`` names the run's namespaces (random when empty); ``node`` is the test node.
    ``node_check``, if given, is called with the node namespace's name after every
    successful sync: a backend's own invariant, checked on every state the cases reach
    (the nftables tests check that the listing reloads); a message it returns fails that
    step's flows with it.
    """

    timeout: float = field(default_factory=default_timeout)
    run_id: str | None = None
    node: StandardNode = field(default=STANDARD_NODE)
    parallel: int = 128
    node_check: Callable[[str], str | None] | None = None


class CaseHandler(Protocol):
    """What the runner drives through a case's steps: the part of the proxier API that
    :class:`~kubeproxy.proxier.Proxier` and :class:`~kubeproxy.proxier.DualStackProxier`
    have, or a :class:`ProxyDriver`'s stand-in for a proxy in another process.

    ``sync_now`` returns once the proxy has applied every change handed over so far
    (True), or when it could not (False: the step's flows fail).
    """

    def on_service_add(self, service: Mapping[str, Any]) -> None:
        """A Service of the case appeared."""

    def on_service_update(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        """A Service of the case changed."""

    def on_service_delete(self, service: Mapping[str, Any]) -> None:
        """A Service of the case was deleted."""

    def on_services_synced(self) -> None:
        """Every Service of the first step was handed over."""

    def on_endpoint_slice_add(self, slice_: Mapping[str, Any]) -> None:
        """An EndpointSlice of the case appeared."""

    def on_endpoint_slice_update(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        """An EndpointSlice of the case changed."""

    def on_endpoint_slice_delete(self, slice_: Mapping[str, Any]) -> None:
        """An EndpointSlice of the case was deleted."""

    def on_endpoint_slices_synced(self) -> None:
        """Every EndpointSlice of the first step was handed over."""

    def sync_now(self) -> bool:
        """Sync (or wait for the proxy's sync); False when it failed."""
        ...


class ProxyDriver(Protocol):
    """Runs a proxy under test that is not a backend in this process (a binary, a
    container): called with the case and its scene once the scene is built, it starts
    the proxy for ``scene.node_ns`` and yields the :class:`CaseHandler` that hands it the
    case's objects (through a fake API server, say) and waits for its syncs; leaving the
    context stops the proxy. What it raises fails every flow of the case (or skips them
    when it says ``kernel lacks ...``)."""

    def __call__(self, case: Case, scene: Scene) -> contextlib.AbstractContextManager[CaseHandler]:
        """Start the proxy for the case's scene; yield its handler."""
        ...


def flow_id(case_file: CaseFile, case: Case, step: Step, flow: Flow) -> str:
    """The stable identifier of a flow (CLI lines, pytest ids)."""
    return f"{case_file.test}/{case.name}/sync{step.sync_number}/{flow.name}"


def resolve_backend(spec: str | BackendFactory) -> BackendFactory:
    """A backend factory from an entry-point name, ``module:attribute``, or a factory."""
    if not isinstance(spec, str):
        return spec
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as err:
            raise BackendNotFound(f"backend {spec!r}: {err}") from None
        if not callable(target):
            raise BackendNotFound(f"backend {spec!r} is not callable")
        return cast(BackendFactory, target)
    try:
        return load_backend(spec)
    except BackendNotFound as err:
        raise BackendNotFound(f"{err}; or give module:attribute") from None
    except ImportError as err:
        raise BackendNotFound(f"backend {spec!r} failed to load: {err}") from None


def sctp_skip_reason() -> str:
    """Why SCTP flows are skipped here ("kernel lacks SCTP ..."), or "" when they run."""
    try:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
    except OSError as err:
        return f"kernel lacks SCTP sockets ({err.strerror}); SCTP flows are not probed"
    probe.close()
    return ""


class _LogCapture(logging.Handler):
    """Keeps what the core and the backend log while a step runs (shown with failures)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("kubeproxy.testing"):
            return
        with contextlib.suppress(Exception):
            message = " ".join(record.getMessage().split())
            if len(message) > 300:
                message = message[:297] + "..."
            if message not in self.messages:
                self.messages.append(message)


@contextlib.contextmanager
def _captured_logs() -> Iterator[_LogCapture]:
    capture = _LogCapture()
    # On the root logger: an out-of-tree backend logs under its own name, not ours.
    root = logging.getLogger()
    root.addHandler(capture)
    try:
        yield capture
    finally:
        root.removeHandler(capture)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While a scene exists, let SIGTERM unwind like Ctrl-C so ``finally`` cleans up.

    Only when SIGTERM still has its default action (which would kill the process and
    leave the namespaces behind) and only in the main thread, where Python handles
    signals; a caller's own handler is left alone.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _ObjectStore:
    """The objects applied so far, by kind and namespace/name (apply = add or update)."""

    def __init__(self) -> None:
        self.services: dict[NamespacedName, Mapping[str, Any]] = {}
        self.slices: dict[NamespacedName, Mapping[str, Any]] = {}


def _key(manifest: Mapping[str, Any]) -> NamespacedName:
    metadata = manifest["metadata"]
    return NamespacedName(metadata.get("namespace", "default"), metadata["name"])


def _apply(handler: CaseHandler, store: _ObjectStore, step: Step) -> list[str]:
    for service in step.services:
        key = _key(service)
        old = store.services.get(key)
        if old is None:
            handler.on_service_add(service)
        else:
            handler.on_service_update(old, service)
        store.services[key] = service
    for slice_ in step.endpoint_slices:
        key = _key(slice_)
        old = store.slices.get(key)
        if old is None:
            handler.on_endpoint_slice_add(slice_)
        else:
            handler.on_endpoint_slice_update(old, slice_)
        store.slices[key] = slice_
    return []


def _delete(handler: CaseHandler, store: _ObjectStore, step: Step) -> list[str]:
    notes = []
    for key in step.deleted_services:
        old = store.services.pop(key, None)
        if old is None:
            notes.append(f"step {step.index}: delete of Service {key}, which was never applied")
        else:
            handler.on_service_delete(old)
    for key in step.deleted_endpoint_slices:
        old = store.slices.pop(key, None)
        if old is None:
            notes.append(
                f"step {step.index}: delete of EndpointSlice {key}, which was never applied"
            )
        else:
            handler.on_endpoint_slice_delete(old)
    return notes


def _make_handler(
    case: Case,
    factory: BackendFactory,
    node: StandardNode,
    netns: str,
    backends: list[Backend],
) -> CaseHandler:
    from kubeproxy.proxier import DualStackProxier, Proxier

    config = node.proxier_config(case.overrides)
    info = node.node_info()

    def addresses() -> Sequence[Any]:
        return node.addresses

    proxiers = []
    for family in case.family.families:
        backend = factory(family, config, netns=netns)
        backends.append(backend)
        proxiers.append(Proxier(family, config, backend, node=info, host_addresses=addresses))
    if len(proxiers) == 2:
        return cast(CaseHandler, DualStackProxier(proxiers[0], proxiers[1]))
    return cast(CaseHandler, proxiers[0])


async def _check_flows(
    scene: Scene, flows: Sequence[Flow], ports: ClientPorts, options: RunOptions
) -> list[Verdict]:
    """Probe and judge the flows of a step: all at once, then those that must reach the
    endpoint an earlier flow reached (``sameEndpointAs``), with what it reached."""
    prober = Prober(ports, timeout=options.timeout, parallel=options.parallel)
    reached: dict[str, set[tuple[IPAddress, int]]] = {}

    async def check(flow: Flow) -> Verdict:
        try:
            namespace = scene.fd(scene.client_namespace(flow.source_ip))
            mark = scene.source_mark(flow)
            observations = await probe_flow(prober, namespace, flow, mark=mark)
            reached[flow.name] = {o.endpoint for o in observations if o.endpoint is not None}
            pinned = None
            if flow.same_endpoint_as is not None:
                pinned = reached.get(flow.same_endpoint_as, set())
            return judge(flow, observations, pinned=pinned)
        except Exception as err:  # one broken probe must not hide the other flows
            logger.exception("probing %s", flow)
            return Verdict(False, f"the runner failed to probe this flow: {err!r}")

    verdicts: dict[int, Verdict] = {}
    for phase in (False, True):
        chosen = [(i, f) for i, f in enumerate(flows) if (f.same_endpoint_as is not None) == phase]
        found = await asyncio.gather(*(check(flow) for _, flow in chosen))
        verdicts.update((i, verdict) for (i, _), verdict in zip(chosen, found, strict=True))
    return [verdicts[i] for i in range(len(flows))]


def run_case(
    case_file: CaseFile,
    case: Case,
    backend: str | BackendFactory,
    options: RunOptions | None = None,
) -> list[FlowResult]:
    """Run one case; return a result for every flow of it, in file order."""
    options = options or RunOptions()
    factory: BackendFactory | None = None

    def start(scene: Scene) -> contextlib.AbstractContextManager[CaseHandler]:
        assert factory is not None
        return _in_process(case, factory, options, scene)

    def resolve() -> None:
        nonlocal factory
        factory = resolve_backend(backend)

    return _run(case_file, case, start, options, prepare=resolve)


def drive_case(
    case_file: CaseFile,
    case: Case,
    driver: ProxyDriver,
    options: RunOptions | None = None,
) -> list[FlowResult]:
    """Run one case against a proxy a :class:`ProxyDriver` runs; return a result for
    every flow of it, in file order. ``options.node`` is the node the driver must make
    the proxy believe it runs on (``scene.plan.node``)."""
    options = options or RunOptions()
    return _run(case_file, case, lambda scene: driver(case, scene), options)


def _run(
    case_file: CaseFile,
    case: Case,
    start: Callable[[Scene], contextlib.AbstractContextManager[CaseHandler]],
    options: RunOptions,
    *,
    prepare: Callable[[], None] | None = None,
) -> list[FlowResult]:
    results: dict[str, FlowResult] = {}
    ordered = [(flow_id(case_file, case, step, flow), step, flow) for step, flow in case.flows]
    has_sctp = any(flow.protocol is L4Protocol.SCTP for _, flow in case.flows)
    sctp_reason = sctp_skip_reason() if has_sctp else ""

    def settle(step: Step, flow: Flow, status: Status, detail: str) -> None:
        identifier = flow_id(case_file, case, step, flow)
        results.setdefault(identifier, FlowResult(identifier, flow, status, detail))

    def fail_rest(reason: str) -> None:
        for _, step, flow in ordered:
            settle(step, flow, Status.FAIL, reason)

    for _, step, flow in ordered:
        if flow.protocol is L4Protocol.SCTP and sctp_reason:
            settle(step, flow, Status.SKIP, sctp_reason)
    try:
        if prepare is not None:
            prepare()
        plan = plan_scene(case, options.node)
        if sctp_reason:
            plan = dataclasses.replace(plan, sctp=False)
        with _sigterm_interrupts(), Scene(plan, run_id=options.run_id) as scene:
            _run_steps(case_file, case, start, scene, options, settle)
    except (BackendNotFound, SceneError) as err:
        fail_rest(str(err))
    finally:
        # A flow not reached (an interrupt, a crash) is a failure, never a silent pass.
        fail_rest("not run: the case stopped before this flow")
    return [results[identifier] for identifier, _, _ in ordered]


@contextlib.contextmanager
def _in_process(
    case: Case, factory: BackendFactory, options: RunOptions, scene: Scene
) -> Iterator[CaseHandler]:
    """The proxier(s) of this process over ``factory``'s backends for the node
    namespace; the backends cleaned up on the way out."""
    backends: list[Backend] = []
    try:
        yield _make_handler(case, factory, options.node, scene.node_ns, backends)
    finally:
        for backend in backends:
            try:
                backend.cleanup()
            except Exception:
                logger.exception("backend cleanup in %s", scene.node_ns)


def _run_steps(
    case_file: CaseFile,
    case: Case,
    start: Callable[[Scene], contextlib.AbstractContextManager[CaseHandler]],
    scene: Scene,
    options: RunOptions,
    settle: Callable[[Step, Flow, Status, str], None],
) -> None:
    with contextlib.ExitStack() as stack:
        try:
            handler = stack.enter_context(start(scene))
        except Exception as err:
            logger.debug("creating the backend", exc_info=True)
            # A backend that says the kernel lacks what it needs (ipvs without IP_VS)
            # cannot be judged here: its flows are skipped, with its words.
            status = Status.SKIP if KERNEL_LACKS in str(err) else Status.FAIL
            for step, flow in case.flows:
                settle(step, flow, status, f"the backend could not be created: {err}")
            return
        store = _ObjectStore()
        ports = ClientPorts(avoid=scene.plan.ports)
        initialized = False
        for step in case.steps:
            with _captured_logs() as logs:
                if step.action is StepAction.APPLY:
                    notes = _apply(handler, store, step)
                elif step.action is StepAction.DELETE:
                    notes = _delete(handler, store, step)
                else:
                    notes = []
                    if not initialized:
                        handler.on_services_synced()
                        handler.on_endpoint_slices_synced()
                        initialized = True
                    ok = handler.sync_now()
            for note in notes:
                logger.warning("%s: %s", case_file.source, note)
            if step.action is not StepAction.SYNC:
                continue
            said = f" (logged: {' | '.join(logs.messages[-3:])})" if logs.messages else ""
            flows = [
                flow
                for flow in step.flows
                if scene.plan.sctp or flow.protocol is not L4Protocol.SCTP
            ]
            if not ok:
                for flow in flows:
                    settle(step, flow, Status.FAIL, f"sync failed{said}")
                continue
            problem = options.node_check(scene.node_ns) if options.node_check else None
            if problem:
                for flow in flows:
                    settle(step, flow, Status.FAIL, f"the node check failed: {problem}")
                continue
            verdicts = asyncio.run(_check_flows(scene, flows, ports, options))
            for flow, verdict in zip(flows, verdicts, strict=True):
                if verdict.passed:
                    settle(step, flow, Status.PASS, verdict.detail)
                else:
                    settle(step, flow, Status.FAIL, verdict.detail + said)


def replay_syncs(
    case: Case,
    factory: BackendFactory,
    netns: str,
    on_sync: Callable[[Step, bool], None],
    *,
    node: StandardNode = STANDARD_NODE,
) -> None:
    """Feed ``case``'s steps through the core into backends from ``factory`` programming
    ``netns``, without a scene and without packets, calling ``on_sync(step, ok)`` after
    each sync step (``ok``: whether the sync succeeded). The backends are cleaned up
    at the end, whatever happens. For comparing what two backends (or executors) write
    for the same cases."""
    backends: list[Backend] = []
    try:
        handler = _make_handler(case, factory, node, netns, backends)
        store = _ObjectStore()
        initialized = False
        for step in case.steps:
            if step.action is StepAction.APPLY:
                _apply(handler, store, step)
            elif step.action is StepAction.DELETE:
                _delete(handler, store, step)
            else:
                if not initialized:
                    handler.on_services_synced()
                    handler.on_endpoint_slices_synced()
                    initialized = True
                on_sync(step, handler.sync_now())
    finally:
        for backend in backends:
            try:
                backend.cleanup()
            except Exception:
                logger.exception("backend cleanup in %s", netns)


def run_file(
    case_file: CaseFile | str | Path,
    backend: str | BackendFactory,
    options: RunOptions | None = None,
) -> list[FlowResult]:
    """Run every case of a file (a path or a parsed :class:`CaseFile`)."""
    if not isinstance(case_file, CaseFile):
        case_file = load_case_file(case_file)
    results: list[FlowResult] = []
    for case in case_file.cases:
        results.extend(run_case(case_file, case, backend, options))
    return results


def run_files(
    paths: Sequence[str | Path],
    backend: str | BackendFactory,
    options: RunOptions | None = None,
) -> list[FlowResult]:
    """Run every case of several files, in order."""
    factory = resolve_backend(backend)
    results: list[FlowResult] = []
    for path in paths:
        results.extend(run_file(path, factory, options))
    return results
