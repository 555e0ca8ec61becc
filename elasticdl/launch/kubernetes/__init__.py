"""The Kubernetes edge: API client, pod manifests, the pod table and its watch, the backend,
the client's submit and the PS/worker pod entry point."""
