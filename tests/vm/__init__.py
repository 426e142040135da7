"""``make test-kernels``: the kernel tests and flow cases on Debian's kernels, in QEMU.

:mod:`tests.vm.matrix` reads the kernel matrix (``tests/vm/kernels.txt``) and finds the
unpacked kernels; :mod:`tests.vm.host` boots each one with virtme-ng and collects what
:mod:`tests.vm.guest` found inside; :mod:`tests.vm.report` compares kernels.
"""
