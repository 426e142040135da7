"""``make test-userspace``: the kernel tests in other Debian userspaces, on this kernel.

``scripts/setup-userspace.sh`` builds each root filesystem and its venv;
:mod:`tests.userspace.run` runs :mod:`tests.vm.guest` in each (through
``scripts/in-userspace.sh``) and reports with :mod:`tests.vm.report`, side by side with
this machine's own userspace.
"""
