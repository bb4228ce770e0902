"""The checks of the command line, by subject; `megatron.training.arguments` runs them."""
