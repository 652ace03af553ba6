"""Several engine replicas behind Ray Serve, routed on chunk residency (docs/deployment.md)."""
