"""Foundations with no knowledge of the model: safe file writes, config fields with their help, plots."""
