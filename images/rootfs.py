"""The image's root file system, assembled from Debian packages the build stage installed.

Runs in the build stage of ``images/Dockerfile`` (Debian's ``python3``, standard library
only)::

    python3 rootfs.py /rootfs PACKAGE...

It takes the named packages and everything they depend on (``Depends`` and
``Pre-Depends``, as installed here), except the packages of :data:`LEFT_OUT`, and copies
their files from this system into ``/rootfs``: what ``dpkg`` unpacked, minus
documentation, manual pages and translations (:data:`EXCLUDED_PATHS`; each package's
``copyright`` stays), plus what their maintainer scripts made here (the CA bundle, the
``iptables`` alternatives). The final stage is that directory and nothing else: no
package manager, no shell, no Perl, no interpreter but Python.

Why not the slim base image with the packages installed on top: the base's package
manager, shell, core utilities and Perl (about 55 of its 75 MB) are never run by the
proxy, and a file in a lower layer costs every node that pulls the image even when an
upper layer deletes it.

What stays true of a Debian system, for operators and their tools: ``/etc/os-release``,
and ``/var/lib/dpkg/status`` with the stanza of every package copied (vulnerability
scanners read both), with ``/var/lib/dpkg/info/<package>.list`` naming the files
actually copied, where they are in the image (merged ``/usr``: ``/usr/lib/...`` for a
package's ``/lib/...``); ``python -m images.build`` reports each package's cost from
them.

It then checks the result: every ELF file must load with the libraries present (the
root's own dynamic loader, ``--list``, in a chroot). Extension modules of Python whose
library was left out are removed first (:data:`UNUSED_EXTENSIONS`, each with why no
code in the image imports it); any other unresolved library stops the build.
"""

from __future__ import annotations

import argparse
import compileall
import fnmatch
import json
import os
import py_compile
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = [
    "EXCLUDED_PATHS",
    "LEFT_OUT",
    "UNUSED_EXTENSIONS",
    "Package",
    "closure",
    "excluded",
    "main",
    "parse_status",
]

DPKG: Final = Path("/var/lib/dpkg")

LEFT_OUT: Final[Mapping[str, str]] = {
    # Maintainer-script machinery: nothing configures packages in the final image.
    "debconf": "answers maintainer scripts' questions; no package is configured in the image",
    "dpkg": "the package manager (python3-minimal depends on it for its scripts)",
    "perl-base": "only debconf's and dpkg's scripts run Perl",
    "readline-common": "the readline library's data; readline is left out (below)",
    # Libraries only extension modules nobody imports link to (UNUSED_EXTENSIONS).
    "libsqlite3-0": "for the sqlite3 module only",
    "libncursesw6": "for the curses module only",
    "libreadline8": "for interactive Python (readline) only",
    "libnsl2": "for the nis module only (with Kerberos and Sun RPC: about 2.5 MB)",
    "libtirpc3": "for the nis module only",
    "libdb5.3": "for the dbm module and iproute2's arpd daemon only",
    "tzdata": "the system time zones; Python's zoneinfo finds the tzdata wheel in the venv",
}
"""Packages the closure does not follow, and why nothing in the image needs them."""

UNUSED_EXTENSIONS: Final[Mapping[str, str]] = {
    "_sqlite3": "sqlite3: no SQL database in the proxy",
    "_curses": "curses: no terminal user interface",
    "_curses_panel": "curses: no terminal user interface",
    "readline": "interactive prompts only",
    "nis": "NIS user lookups: none",
    "_dbm": "dbm: no key-value files",
    "_gdbm": "dbm: no key-value files",
}
"""Extension modules of the standard library removed because their library is left
out; ``tests/test_images.py`` checks that a daemon run imports none of them."""

UNUSED_FILES: Final[Mapping[str, str]] = {
    "/usr/sbin/arpd": "iproute2's ARP daemon (needs libdb5.3); never run on a node by us",
}
"""Single files removed because a library they need is left out."""

EXCLUDED_PATHS: Final = (
    "/usr/share/doc/*",
    "/usr/share/man/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
    "/usr/share/bug/*",
    "/usr/share/bash-completion/*",
    "/usr/share/zsh/*",
    "/usr/share/gcc/*",
    "/usr/share/gdb/*",
    "/usr/share/common-licenses/*",
    "/usr/lib/x86_64-linux-gnu/gconv/*",
    "/usr/lib/python3.11/pydoc_data/*",
    "/usr/lib/python3.11/test/*",
)
"""Paths never copied: documentation, manual pages, translations (Debian's slim images
leave out the same), shell completions, debugger helpers, and glibc's iconv(3)
character-set modules (7 MB; Python has codecs of its own, and no tool here converts
character sets); of the standard library, the help topics of interactive ``help()``
(``pydoc_data``) and CPython's own regression-test support (``test``), which nothing
imports outside an interpreter's test run. The rest of the standard library stays: an
import on a path no measurement took must not fail on a node (``pyroute2`` imports
``unittest`` at run time, ``kubernetes.watch`` imports ``pydoc``)."""
KEPT_PATHS: Final = ("/usr/share/doc/*/copyright",)
"""Exceptions to :data:`EXCLUDED_PATHS`: each package's licence terms stay."""

GENERATED: Final[Mapping[str, tuple[str, ...]]] = {
    # update-ca-certificates makes the bundle and the hashed links from the package's
    # certificates; Python's ssl finds them through /usr/lib/ssl/certs (openssl).
    "ca-certificates": ("/etc/ssl/certs",),
}
"""Paths a package's maintainer scripts create (not in its file list), copied with it."""

_ALTERNATIVE_DIRS: Final = ("/usr/bin", "/usr/sbin", "/bin", "/sbin")
_ELF_MAGIC: Final = b"\x7fELF"


@dataclass(frozen=True, slots=True)
class Package:
    """One installed package: its name, its architecture and its dependency fields."""

    name: str
    architecture: str
    depends: tuple[tuple[str, ...], ...]
    """Depends and Pre-Depends: each entry the names of its alternatives, in order."""
    provides: tuple[str, ...]
    stanza: str = field(repr=False)


def _fields(stanza: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    name = ""
    for line in stanza.splitlines():
        if line[:1] in (" ", "\t") and name:
            fields[name] += "\n" + line
        elif ":" in line:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return fields


_NAME: Final = re.compile(r"^\s*([a-z0-9][a-z0-9+.-]*)")


def _names(relation: str) -> tuple[tuple[str, ...], ...]:
    """``a (>= 1) | b:any, c`` -> ``(("a", "b"), ("c",))`` (versions and arches dropped)."""
    groups = []
    for group in relation.split(","):
        names = []
        for alternative in group.split("|"):
            match = _NAME.match(alternative)
            if match:
                names.append(match.group(1))
        if names:
            groups.append(tuple(names))
    return tuple(groups)


def parse_status(text: str) -> dict[str, Package]:
    """The installed packages of a dpkg status file, by name."""
    packages: dict[str, Package] = {}
    for stanza in re.split(r"\n\s*\n", text):
        fields = _fields(stanza)
        if "Package" not in fields or not fields.get("Status", "").endswith(" installed"):
            continue
        depends = _names(fields.get("Pre-Depends", "")) + _names(fields.get("Depends", ""))
        provides = tuple(names[0] for names in _names(fields.get("Provides", "")))
        name = fields["Package"]
        packages[name] = Package(
            name, fields.get("Architecture", "all"), depends, provides, stanza.strip() + "\n"
        )
    return packages


def closure(
    installed: Mapping[str, Package], wanted: Iterable[str], left_out: Iterable[str] = LEFT_OUT
) -> tuple[list[str], set[str]]:
    """The packages ``wanted`` needs (in the order found) and those of ``left_out`` it
    would have needed. A dependency none of whose alternatives is installed (or provided
    by an installed package) raises ``LookupError``."""
    providers: dict[str, list[str]] = {}
    for package in installed.values():
        for virtual in package.provides:
            providers.setdefault(virtual, []).append(package.name)
    skip = set(left_out)
    order: list[str] = []
    seen: set[str] = set()
    skipped: set[str] = set()
    queue = list(wanted)
    while queue:
        name = queue.pop(0)
        if name in seen:
            continue
        if name not in installed:
            raise LookupError(f"{name} is not installed")
        seen.add(name)
        order.append(name)
        for alternatives in installed[name].depends:
            chosen = _choose(alternatives, installed, providers)
            if chosen is None:
                raise LookupError(f"{name}: none of {' | '.join(alternatives)} is installed")
            if chosen in skip:
                skipped.add(chosen)
            elif chosen not in seen:
                queue.append(chosen)
    return order, skipped


def _choose(
    alternatives: Sequence[str],
    installed: Mapping[str, Package],
    providers: Mapping[str, Sequence[str]],
) -> str | None:
    for name in alternatives:
        if name in installed:
            return name
        if providers.get(name):
            return providers[name][0]
    return None


def excluded(path: str) -> bool:
    """Whether a packaged path stays out of the image (:data:`EXCLUDED_PATHS`)."""
    if any(fnmatch.fnmatchcase(path, pattern) for pattern in KEPT_PATHS):
        return False
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in EXCLUDED_PATHS)


def _list_file(package: Package) -> Path:
    qualified = DPKG / "info" / f"{package.name}:{package.architecture}.list"
    return qualified if qualified.exists() else DPKG / "info" / f"{package.name}.list"


class Assembler:
    """Copies paths of this system into ``root``, keeping the merged-/usr layout: a path
    under a symlinked directory (``/lib`` -> ``usr/lib``) lands where the link leads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.copied: dict[str, list[str]] = {}

    def target(self, path: str) -> Path:
        """Where ``path`` of this system goes under the root (its directory resolved)."""
        return _inside(self.root, path)

    def top_level_links(self) -> None:
        """``/bin``, ``/lib``... as symbolic links where this system has them."""
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in sorted(Path("/").iterdir()):
            if entry.is_symlink() and not (self.root / entry.name).is_symlink():
                (self.root / entry.name).symlink_to(os.readlink(entry))

    def _directory(self, source: Path, target: Path) -> None:
        if target.is_dir():
            return
        self._directory(source.parent, target.parent)
        target.mkdir()
        info = source.stat()
        os.chmod(target, stat.S_IMODE(info.st_mode))
        os.chown(target, info.st_uid, info.st_gid)

    def copy(self, path: str, owner: str) -> bool:
        """Copy one path (a file, a link, or a directory without its contents); False
        when this system has nothing there."""
        source = Path(path)
        if not os.path.lexists(source):
            return False
        target = self.target(path)
        if source.is_dir() and not source.is_symlink():
            self._directory(Path(os.path.realpath(source)), target)
            return True
        self._directory(Path(os.path.realpath(source.parent)), target.parent)
        if os.path.lexists(target):
            target.unlink()
        shutil.copy2(source, target, follow_symlinks=False)
        info = source.lstat()
        os.lchown(target, info.st_uid, info.st_gid)
        self.copied.setdefault(owner, []).append(path)
        return True

    def copy_tree(self, path: str, owner: str) -> None:
        """Copy a directory with everything in it."""
        for directory, dirs, files in os.walk(path):
            self.copy(directory, owner)
            for name in sorted(files) + [d for d in dirs if os.path.islink(f"{directory}/{d}")]:
                self.copy(f"{directory}/{name}", owner)


def copy_packages(assembler: Assembler, installed: Mapping[str, Package], names: list[str]) -> None:
    """Every file of every package named, as :func:`excluded` allows, with its generated
    paths (:data:`GENERATED`)."""
    for name in names:
        package = installed[name]
        for line in _list_file(package).read_text().splitlines():
            if line and line != "/." and not excluded(line):
                assembler.copy(line, name)
        for path in GENERATED.get(name, ()):
            assembler.copy_tree(path, name)


def copy_alternatives(assembler: Assembler) -> None:
    """The alternatives (``/usr/sbin/iptables`` -> ``/etc/alternatives/iptables`` ->
    ``xtables-nft-multi``) whose chosen file was copied."""
    alternatives = Path("/etc/alternatives")
    if not alternatives.is_dir():
        return
    for link in sorted(alternatives.iterdir()):
        if not link.is_symlink():
            continue
        chosen = os.readlink(link)
        if os.path.lexists(assembler.target(chosen)) and not excluded(chosen):
            assembler.copy(str(link), "alternatives")
    for directory in _ALTERNATIVE_DIRS:
        if not os.path.isdir(directory) or os.path.islink(directory):
            continue
        for entry in sorted(Path(directory).iterdir()):
            if (
                entry.is_symlink()
                and os.readlink(entry).startswith(str(alternatives) + "/")
                and os.path.lexists(assembler.target(os.readlink(entry)))
            ):
                assembler.copy(str(entry), "alternatives")


def system_files(root: Path) -> None:
    """What a container's root needs besides packages: users, the loader's cache, the
    directories runtimes mount over."""
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    for directory, mode in (("tmp", 0o1777), ("run", 0o755), ("root", 0o700), ("var/tmp", 0o1777)):
        (root / directory).mkdir(parents=True, exist_ok=True)
        os.chmod(root / directory, mode)
    if not os.path.lexists(root / "var/run"):
        (root / "var/run").symlink_to("/run")
    conf = root / "etc/ld.so.conf"
    if not conf.exists():
        conf.write_text("include /etc/ld.so.conf.d/*.conf\n")
    subprocess.run(["ldconfig", "-r", str(root)], check=True)


def write_dpkg_database(
    root: Path, installed: Mapping[str, Package], names: list[str], copied: Mapping[str, list[str]]
) -> None:
    """``var/lib/dpkg/status`` with the copied packages' stanzas, and their file lists."""
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True, exist_ok=True)
    stanzas = [installed[name].stanza for name in sorted(names)]
    (root / "var/lib/dpkg/status").write_text("\n".join(stanzas))
    for name in names:
        inside = [_inside(root, p) for p in copied.get(name, [])]
        paths = sorted({"/" + str(p.relative_to(root)) for p in inside if os.path.lexists(p)})
        (info / f"{name}.list").write_text("".join(f"{p}\n" for p in paths))


def _inside(root: Path, path: str) -> Path:
    parent = Path(os.path.realpath(Path(path).parent))
    return root / (parent / Path(path).name).relative_to("/")


def compile_python(root: Path) -> bool:
    """Compile the standard library under ``root`` to bytecode (``unchecked-hash``: see
    ``prune.py``), recording the paths as they are inside the image; True when every
    module compiled."""
    ok = True
    for library in sorted(root.glob("usr/lib/python3*")):
        ok &= compileall.compile_dir(
            library,
            quiet=1,
            workers=0,
            stripdir=str(root),
            prependdir="/",
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
    return ok


def elf_files(root: Path) -> Iterator[Path]:
    """Every regular ELF file under ``root``."""
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            if path.is_symlink() or not path.is_file():
                continue
            with open(path, "rb") as handle:
                if handle.read(4) == _ELF_MAGIC:
                    yield path


def missing_libraries(root: Path, path: Path) -> list[str]:
    """The libraries ``path`` needs that the root's loader cannot find (``not found``)."""
    inside = "/" + str(path.relative_to(root))
    result = subprocess.run(
        ["chroot", str(root), "/lib64/ld-linux-x86-64.so.2", "--list", inside],
        capture_output=True,
        text=True,
        check=False,
    )
    return [
        line.split("=>")[0].strip() for line in result.stdout.splitlines() if "not found" in line
    ]


def _extension_name(path: Path) -> str | None:
    """``_sqlite3`` for ``.../lib-dynload/_sqlite3.cpython-311-x86_64-linux-gnu.so``."""
    if path.parent.name != "lib-dynload":
        return None
    return path.name.split(".", 1)[0]


def check_libraries(root: Path) -> list[str]:
    """Remove :data:`UNUSED_EXTENSIONS` and :data:`UNUSED_FILES` whose libraries are
    missing; return what else cannot load (one line each)."""
    problems = []
    for path in sorted(elf_files(root)):
        missing = missing_libraries(root, path)
        if not missing:
            continue
        inside = "/" + str(path.relative_to(root))
        if _extension_name(path) in UNUSED_EXTENSIONS or inside in UNUSED_FILES:
            path.unlink()
            continue
        problems.append(f"{inside}: {', '.join(missing)} not found")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Assemble the root (see the module docstring); 1 when a file cannot load."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("packages", nargs="+")
    args = parser.parse_args(argv)
    installed = parse_status((DPKG / "status").read_text())
    names, skipped = closure(installed, args.packages)
    assembler = Assembler(args.root)
    assembler.top_level_links()
    copy_packages(assembler, installed, names)
    copy_alternatives(assembler)
    system_files(args.root)
    problems = check_libraries(args.root)
    if not compile_python(args.root):
        problems.append("the standard library did not compile")
    write_dpkg_database(args.root, installed, names, assembler.copied)
    print(json.dumps({"packages": names, "left_out": sorted(skipped)}))
    for problem in problems:
        print(f"rootfs: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
