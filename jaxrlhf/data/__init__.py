"""Datasets and prompt formats."""
