"""podrl: GRPO-style reinforcement learning for LLMs as Kubernetes microservices."""

__version__ = "0.1.0"
