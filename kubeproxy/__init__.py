"""kubeproxy: Kubernetes service proxying for Linux, as a reusable core plus renderers."""
