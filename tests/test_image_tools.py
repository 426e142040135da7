"""The tools that build the image (``images/*.py``), on their own, and the measurement
that decides what the image leaves out.

The measurement (:mod:`images.imports`, a kernel test: each daemon run has a network
namespace) runs the DaemonSet's binary with the ConfigMap's configuration against the
fake API server once per way a node authenticates; the test fails when the image would
lack a module any run imported (``images/prune.py``'s rules), or when a run imported a
standard-library extension ``images/rootfs.py`` removes.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from images import base, deployment, prune, rootfs, sizes, wheels
from images.build import TARGET
from images.imports import AUTHS, distribution_of, image_distributions, measure

# --- rootfs.py: the packages and paths of the final stage ------------------------------

STATUS = """\
Package: tool
Status: install ok installed
Architecture: amd64
Version: 1
Depends: libtool (>= 1), debconf (>= 0.5) | debconf-2.0, media-types | mime-support
Pre-Depends: libc6

Package: libtool
Status: install ok installed
Architecture: amd64
Version: 1
Depends: libc6

Package: libc6
Status: install ok installed
Architecture: amd64
Version: 2.36
Description: the C library
 continued here

Package: debconf
Status: install ok installed
Architecture: all
Version: 1
Provides: debconf-2.0
Depends: perl-base

Package: mime-support
Status: install ok installed
Architecture: all
Version: 1

Package: removed
Status: deinstall ok config-files
Version: 1
"""


def test_the_closure_follows_dependencies_and_leaves_out_what_it_is_told() -> None:
    installed = rootfs.parse_status(STATUS)
    assert set(installed) == {"tool", "libtool", "libc6", "debconf", "mime-support"}
    assert installed["libc6"].stanza.endswith(" continued here\n")
    names, skipped = rootfs.closure(installed, ["tool"])
    # Pre-Depends first; an alternative that is not installed is passed over.
    assert names == ["tool", "libc6", "libtool", "mime-support"]
    assert skipped == {"debconf"}
    # Followed, debconf would need perl-base, which is not installed.
    with pytest.raises(LookupError, match="debconf: none of perl-base is installed"):
        rootfs.closure(installed, ["tool"], left_out=())


def test_documentation_stays_out_but_the_licences() -> None:
    assert rootfs.excluded("/usr/share/doc/libc6/changelog.Debian.gz")
    assert not rootfs.excluded("/usr/share/doc/libc6/copyright")
    assert rootfs.excluded("/usr/share/man/man8/nft.8.gz")
    assert rootfs.excluded("/usr/share/locale/de/LC_MESSAGES/libc.mo")
    assert rootfs.excluded("/usr/lib/x86_64-linux-gnu/gconv/UTF-16.so")
    assert not rootfs.excluded("/usr/sbin/nft")
    # Of the standard library (of the image's Python), only what no program imports.
    python = f"/usr/lib/python{TARGET.python}"
    assert rootfs.excluded(f"{python}/pydoc_data/topics.py")
    assert rootfs.excluded(f"{python}/test/support/__init__.py")
    for kept in ("json/__init__.py", "unittest/mock.py", "pydoc.py", "asyncio/events.py"):
        assert not rootfs.excluded(f"{python}/{kept}"), kept


def test_every_left_out_library_is_only_for_removed_modules_or_files() -> None:
    # What rootfs.py removes when its library is missing is named with a reason; the
    # measured daemon imports none of it (test_the_image_holds_every_module_...).
    assert set(rootfs.UNUSED_EXTENSIONS) >= {"_sqlite3", "_curses", "readline", "nis", "_dbm"}
    assert all(reason for reason in rootfs.LEFT_OUT.values())
    assert set(rootfs.UNUSED_FILES) == {"/usr/sbin/arpd"}


# --- prune.py: the virtual environment ---------------------------------------------------


def test_prune_keeps_the_client_but_its_generated_classes_and_the_asyncio_client() -> None:
    kept = [
        "kubernetes",
        "kubernetes.client",
        "kubernetes.client.api_client",
        "kubernetes.client.models",
        "kubernetes.client.api",
        "kubernetes.config.kube_config",
        "kubernetes.config.exec_provider",
        "kubernetes.config.incluster_config",
        "kubernetes.watch.watch",
        "kubernetes.stream.ws_client",
    ]
    for name in kept:
        assert not prune.dropped_module(name, "kubernetes"), name
    for name in (
        "kubernetes.client.models.v1_pod",
        "kubernetes.client.api.core_v1_api",
        "kubernetes.aio",
        "kubernetes.aio.client.api_client",
        "kubernetes.config.kube_config_test",
    ):
        assert prune.dropped_module(name, "kubernetes"), name
    assert prune.dropped_module("aiohttp.client", "aiohttp")
    assert prune.dropped_module("pip", "pip")
    assert not prune.dropped_module("urllib3", "urllib3")
    assert not prune.dropped_module("json", None)
    assert prune.dropped_file("kubernetes/client/models/__pycache__/v1_pod.cpython-311.pyc")
    assert not prune.dropped_file("kubernetes/client/models/__init__.py")


def test_prune_removes_distributions_by_their_record(tmp_path: Path) -> None:
    site = tmp_path / "lib/python3.11/site-packages"
    for name, files in (("aiohttp", ["aiohttp/__init__.py"]), ("urllib3", ["urllib3/x.py"])):
        info = site / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))
        for file in files:
            (site / file).parent.mkdir(parents=True, exist_ok=True)
            (site / file).write_text("")
    models = site / "kubernetes/client/models"
    models.mkdir(parents=True)
    (models / "__init__.py").write_text("")
    (models / "v1_pod.py").write_text("x" * 100)
    assert prune.site_packages(tmp_path) == site
    assert prune.remove_distributions(site, prune.DROPPED_DISTRIBUTIONS) == ["aiohttp"]
    assert prune.prune_kubernetes(site) == 100
    left = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file())
    assert left == [
        "kubernetes/client/models/__init__.py",
        "urllib3-1.0.dist-info/METADATA",
        "urllib3-1.0.dist-info/RECORD",
        "urllib3/x.py",
    ]


# --- wheels.py, base.py: the host's settings ------------------------------------------------


def test_the_wheels_platforms_are_every_manylinux_the_glibc_runs() -> None:
    tags = wheels.manylinux_platforms(wheels.Target("3.11", (2, 36), "x86_64"))
    assert tags[0] == "manylinux_2_36_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_37_x86_64" not in tags
    report = {
        "install": [
            {"metadata": {"name": "kubeproxy", "version": "0.1.0"}},
            {"metadata": {"name": "PyYAML", "version": "6.0.4"}},
            {"metadata": {"name": "typing_extensions", "version": "4.16.0"}},
        ]
    }
    assert wheels.resolved(report, exclude="kubeproxy") == {
        "pyyaml": "6.0.4",
        "typing-extensions": "4.16.0",
    }


def test_the_base_is_made_with_the_hosts_apt_proxy_and_the_slim_exclusions() -> None:
    dump = (
        'Acquire::http::Proxy "http://proxy.corp:3128";\n'
        'Acquire::Languages "none";\n'
        'Acquire::https::CaInfo "/etc/ssl/certs/corp.pem";\n'
    )
    options = base.apt_host_options(dump)
    assert options == [
        'Acquire::http::Proxy "http://proxy.corp:3128";',
        'Acquire::https::CaInfo "/etc/ssl/certs/corp.pem";',
    ]
    argv = base.mmdebstrap_argv("bookworm", Path("/tmp/b.tar"), options)
    assert argv[:3] == ["mmdebstrap", "--quiet", "--variant=minbase"]
    assert "--dpkgopt=path-exclude=/usr/share/doc/*" in argv
    assert '--aptopt=Acquire::http::Proxy "http://proxy.corp:3128";' in argv
    assert argv[-4:-3] == ["/tmp/b.tar"] and argv[-1].endswith("bookworm-security main")


# --- sizes.py: what a node pulls ----------------------------------------------------------


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_sizes_reads_a_saved_image_once_and_attributes_every_file() -> None:
    system = _tar(
        {
            "usr/sbin/nft": b"\0" * 4000,
            "usr/lib/python3.11/json/__init__.py": b"#" * 300,
            "usr/lib/python3.11/json/__pycache__/__init__.cpython-311.pyc": b"c" * 200,
            "var/lib/dpkg/info/nftables.list": b"/usr/sbin/nft\n",
            "var/lib/dpkg/info/libpython3.11-stdlib.list": (
                b"/usr/lib/python3.11/json/__init__.py\n"
            ),
            "etc/passwd": b"root:x:0:0::/root:/usr/sbin/nologin\n",
        }
    )
    venv = _tar(
        {
            "opt/kubeproxy/lib/python3.11/site-packages/yaml/__init__.py": b"y" * 1000,
            "opt/kubeproxy/lib/python3.11/site-packages/PyYAML-6.0.4.dist-info/RECORD": b"r",
            "opt/kubeproxy/bin/kube-proxy-nftables": b"#!/opt/kubeproxy/bin/python\n",
        }
    )
    manifest = json.dumps([{"Config": "c.json", "Layers": ["a/layer.tar", "b/layer.tar"]}])
    archive = _tar(
        {
            "b/layer.tar": venv,
            "c.json": b"{}",
            "a/layer.tar": system,
            "manifest.json": manifest.encode(),
        }
    )
    measured = sizes.measure(io.BytesIO(archive))
    assert [layer.unpacked for layer in measured.layers] == [len(system), len(venv)]
    assert all(0 < layer.compressed < layer.unpacked for layer in measured.layers)
    assert measured.parts["deb: nftables"] == 4000
    assert measured.parts["deb: libpython3.11-stdlib"] == 500
    assert measured.parts["venv: yaml"] == 1000
    assert measured.parts["venv: pyyaml"] == 1
    assert measured.unpacked == sum(measured.parts.values())
    assert list(sizes.summary({"a": 3, "b": 2, "c": 1}, top=1)) == [("a", 3), ("2 others", 3)]


# --- deployment.py: the pod's containers as runtime flags --------------------------------


def test_the_pods_containers_become_the_runtime_flags_the_manifest_means() -> None:
    volumes = {
        "kube-proxy": Path("/t/cm"),
        "xtables-lock": Path("/t/lock"),
        "lib-modules": Path("/t/modules"),
        "tmp": Path("/t/tmp"),
        "state": Path("/t/state"),
    }
    proxy = deployment.container_run(
        deployment.container("kube-proxy"), node_name="n1", volumes=volumes
    )
    flags = " ".join(proxy.flags)
    assert "--cap-drop ALL --cap-add NET_ADMIN --cap-add NET_RAW --cap-add SYS_RESOURCE" in flags
    assert "--read-only" in proxy.flags and "--privileged" not in proxy.flags
    assert "--security-opt no-new-privileges" in flags
    assert "-e NODE_NAME=n1" in flags
    assert "-v /t/cm:/var/lib/kube-proxy:ro" in flags
    assert "-v /t/lock:/run/xtables.lock " in flags + " "
    assert "-v /t/tmp:/tmp " in flags + " "
    assert "-v /t/state:/var/lib/kubeproxy " in flags + " "
    assert (proxy.entrypoint, proxy.args) == (
        "kube-proxy-nftables",
        ("--config=/var/lib/kube-proxy/config.conf", "--hostname-override=n1"),
    )
    init = deployment.container_run(
        deployment.container("init", init=True), node_name="n1", volumes=volumes
    )
    assert init.flags[0] == "--privileged" and "--cap-drop" not in init.flags
    assert init.args[-1] == "--init-only"


def test_the_configuration_changes_only_fields_the_configmap_has() -> None:
    text = deployment.configuration({"clusterCIDR": "10.0.0.0/8", "conntrack.min": 0})
    assert "clusterCIDR: 10.0.0.0/8" in text and "min: 0" in text
    assert "mode: nftables" in text
    with pytest.raises(KeyError, match="clusterCIDRs"):
        deployment.configuration({"clusterCIDRs": "10.0.0.0/8"})
    kubeconfig = deployment.kubeconfig("https://127.0.0.1:6443")
    assert "server: https://127.0.0.1:6443" in kubeconfig
    assert "tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token" in kubeconfig


# --- the measurement: what a running proxy imports ---------------------------------------


@pytest.mark.kernel
def test_the_image_holds_every_module_a_daemon_run_imports() -> None:
    runs = measure()
    assert [run.auth for run in runs] == list(AUTHS)
    installed = image_distributions()
    assert {"kubernetes", "pyroute2", "urllib3", "pydantic"} <= installed
    for run in runs:
        assert run.exit_code == 0, run.log[-2000:]
        assert run.events == ("FailedToStartServiceHealthcheck", "Starting"), run.log[-2000:]
        imported = {n: f for n, f in run.modules.items() if n not in run.start}
        missing = [
            name
            for name, file in imported.items()
            if prune.dropped_module(name, distribution_of(file))
        ]
        assert missing == [], f"{run.auth}: the image would lack {missing}"
        extensions = {name.rpartition(".")[2] for name in imported} & set(rootfs.UNUSED_EXTENSIONS)
        assert extensions == set(), run.auth
        # The client's configuration loading for this auth ran.
        assert "kubernetes.config.kube_config" in imported
        assert "kubernetes.client.rest" in imported
