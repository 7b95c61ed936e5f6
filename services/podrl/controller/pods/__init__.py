"""The worker pods: who registered, which pods a step uses, the Kubernetes view, scaling and
the clients of a pod's services."""
