"""Building and measuring the DaemonSet's container image (``make image``).

* :mod:`images.runtime`: the container runtime found here (docker with a running engine,
  or podman) and the few commands the build and the tests give it;
* :mod:`images.base`: the base image, the registry's when one is reachable, else one
  made from the same Debian suite's packages with mmdebstrap;
* :mod:`images.wheels`: the Python wheels the image installs, downloaded on the host with
  the host's own package-registry settings;
* :mod:`images.sizes`: what a node pulls (compressed layers), what it unpacks, and what
  each part costs;
* :mod:`images.build`: ``python -m images.build``, all of the above.

``images/rootfs.py`` and ``images/prune.py`` run inside the build stage of
``images/Dockerfile`` (Debian's Python, standard library only) and import nothing from
here.
"""
