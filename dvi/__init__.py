"""dvi: Draft, Verify, Improve -- online drafter adaptation for speculative decoding.

The core library: speculative maths (`speculative`), the decoding engine (`engine`), model pairs (`models`),
EAGLE-3 drafters for vLLM (`eagle3`), the DecisionRecord codec (`records`), the control protocol (`control`), typed
config with every cross-group check (`config`), the model store (`store`), the swap policy (`swap`), serving
metrics (`metrics`), the one MLflow client (`tracking`) and child processes (`procs`, `mlflow_server`). None of
these imports a package above it: `dvi.serving` composes a replica from them, `streams` carries records and control
messages over Kafka, `trainers` holds the DeepSpeed recipe, and `dvi.cli` (the shell) wires them all into the
`dvi` command.
"""

__version__ = "0.1.0"
