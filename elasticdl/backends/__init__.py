"""Where roles run: local child processes (and, later, Kubernetes pods)."""
