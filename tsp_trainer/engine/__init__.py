"""DeepSpeed ZeRO under Accelerate, and the device checks made before either starts. The only
package that imports accelerate or deepspeed (tests/unit/test_layering.py checks it)."""
