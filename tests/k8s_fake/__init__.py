"""A Kubernetes stand-in for tests: fake API server, simulated kubelet and kube-proxy."""
