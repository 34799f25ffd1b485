"""Checkpoints: atomic, self-describing, verified on load (manager); layout-free model and optimizer
shards (shards, reshard: resume under another D x DP); Hugging Face import and export (hf,
export_cli: tsp-export)."""
