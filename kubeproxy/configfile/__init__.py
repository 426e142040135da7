"""Upstream's configuration file, ``KubeProxyConfiguration`` (``kubeproxy.config.k8s.io``).

Three modules, in the order a file goes through them:

* :mod:`~kubeproxy.configfile.model`: every v1alpha1 field as frozen dataclasses with
  upstream's names and defaults, Go durations, the format's constants and
  :class:`~kubeproxy.configfile.model.ConfigError`;
* :mod:`~kubeproxy.configfile.codec`: reading and writing the file, strictly, with
  upstream's defaulting;
* :mod:`~kubeproxy.configfile.settings`: upstream's start-up defaults and validation, and
  the conversion to the settings a proxier runs with
  (:class:`~kubeproxy.config.ProxierConfig`). Each name is imported from the module
  that defines it.

Why apart from the core: the core takes its settings as :mod:`kubeproxy.config` values,
whoever made them (this file, the flags, a test, an out-of-tree proxy's own code), and
never reads the file. This package sits above the core (it imports ``config``,
``featuregates`` and ``objects``, which never import it) and below the daemon and the
binaries, which call it. The feature gates stay at the top of :mod:`kubeproxy`
(:mod:`kubeproxy.featuregates`): ``ProxierConfig`` holds them and the nftables backend
reads them.

Nothing is imported here, so that reading the model (the logging setup,
:mod:`kubeproxy.logs`, reads its section) does not load the codec's YAML parser or the
conversion; the model imports nothing of ``kubeproxy``.
"""
