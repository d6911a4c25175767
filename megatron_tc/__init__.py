"""megatron_tc: hybrid Gated DeltaNet students from pretrained Transformers, Taylor-Calibrate
initialization, and distillation with DeepSpeed and Megatron-style parallelism.

Importing the package is cheap: deepspeed, megatron-core and flash-linear-attention are imported
only by the modules that use them.
"""
__version__ = "0.1.0"
