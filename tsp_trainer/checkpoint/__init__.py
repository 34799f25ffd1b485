"""Checkpoints: atomic, self-describing, verified on load (manager); layout-free model shards
(shards); Hugging Face export/import (hf)."""
