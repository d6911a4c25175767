"""megatron_tc: hybrid Gated DeltaNet students from pretrained Transformers, Taylor-Calibrate
initialization, and distillation with DeepSpeed and Megatron-style parallelism.

Importing the package is cheap: deepspeed, megatron-core and flash-linear-attention are imported
only by the modules that use them.
"""
__version__ = "0.1.0"

# Exported hybrid students load with AutoModelForCausalLM after `import megatron_tc`. The classes
# are registered lazily (the first time transformers' Auto classes are imported), so importing the
# package does not pull in transformers' model code.
from megatron_tc.convert.registration import install as _install_hf_registration

_install_hf_registration()
