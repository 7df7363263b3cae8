"""Test helpers: toy models, paged batches, harnesses against transformers."""
