"""The worker pods: the pod table (who registered, which pods a step uses, the epoch), the
Kubernetes view and scaling."""
