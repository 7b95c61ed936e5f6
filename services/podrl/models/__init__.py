"""Model helpers shared by trainer and generator (needs torch and transformers)."""
