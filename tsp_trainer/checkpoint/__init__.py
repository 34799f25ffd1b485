"""Checkpoints. The Trainer's one entry point is TrainingCheckpoints (training: save, load, prune);
what a checkpoint holds besides the shards (train_state); the layout-free model and optimizer
shards (shards, reshard: resume under another D x DP); writing in three phases (writer, with the
background thread of async saves in background); publication and keep-last-K (store); the
folder's names, manifest and atomic writes (disk_format); Hugging Face import and export (hf,
export_cli: tsp-export)."""
