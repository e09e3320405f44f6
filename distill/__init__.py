"""Mixture-of-Students: a shallower PR-MoE student trained with staged knowledge distillation."""
