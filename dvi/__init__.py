"""dvi: Draft, Verify, Improve -- online drafter adaptation for speculative decoding.

The core package: speculative maths, the decoding engine, model loading, typed config and the CLI.
It imports torch and transformers only; Kafka lives in `streams`, DeepSpeed and MLflow in `trainers`.
"""

__version__ = "0.1.0"
