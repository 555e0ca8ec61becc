"""Where roles run: the backend contract, local child processes and Kubernetes pods."""
