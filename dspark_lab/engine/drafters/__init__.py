"""Drafters: what proposes tokens for the target to verify."""
