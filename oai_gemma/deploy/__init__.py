"""Running oai-gemma as replicas on an existing engine: Ray Serve (`ray_serve`); Kubernetes lives in `deploy/kubernetes/`."""
