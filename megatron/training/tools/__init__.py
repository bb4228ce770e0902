"""Tools beside training: preprocessing text into indexed datasets, and the table of
Megatron-LM's flags (docs/megatron_flags.md)."""
