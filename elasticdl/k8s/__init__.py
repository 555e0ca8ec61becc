"""Kubernetes: manifests, the client wrapper, the pod watch loop and job submission."""
