"""ReCoVer's Megatron-LM-compatible training front-end (arguments, model, data, loop).

`megatron` itself is the namespace provided by the megatron-core package; this repo only adds
`megatron.training`. There is deliberately no `megatron/__init__.py` here.
"""
