"""GRPO-family algorithms: group-relative advantages (pure Python) and policy losses (torch).

``podrl.algorithms.advantages`` imports nothing beyond the standard library (the controller uses
it without torch); ``podrl.algorithms.losses`` needs torch.
"""
