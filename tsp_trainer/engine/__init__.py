"""The only importer of accelerate and deepspeed (DESIGN.md section 7)."""
