"""The pipeline engine, beside the three layers: the 1F1B and interleaved schedules over an explicit
id list (`schedule`, the order: `interleaved`), stage-to-stage p2p (`p2p`), one pipeline stage of
megatron-core's GPTModel (`stage`), the id-addressed sampler, the loss and the per-microbatch RNG."""
