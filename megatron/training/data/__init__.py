"""The data a run trains on: megatron-core's datasets and the tokenizers."""
