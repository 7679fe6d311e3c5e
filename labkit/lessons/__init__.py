"""What the notebooks call beyond training an engine: the lessons' own instruments.

    fsdp2_inspect      what `fully_shard` makes of a parameter, per-block mixed precision, its first-step log
    fsdp2_features     HSDP, TP + FSDP on a 2-D mesh, DCP across world sizes, ignored params, compile
    deepspeed_inspect  DeepSpeed's own accounting (comms logger, estimator) beside labkit's probe
    parity             FSDP2 and DeepSpeed at matched granularity, timed in interleaved pairs
    foreign            the scratch engine on torch's own encoder layers, a model the lab did not write
    engine_inspect     FSDP1's flat parameters and the scratch engine's hook order, read on live ranks (02)
    roofline           exposed communication against tokens per rank over an emulated link (08)
    overlap            prefetch off, on and on with no link, interleaved, and what they show (03)
    production         FSDP2's production surface: accumulation, clipping, meta init, export, resharding
    production_deepspeed  DeepSpeed's: gradient accumulation, torch.autocast, bf16 master weights
    clinic             the debugging clinic's cases: each broken run, its fix, the evidence and the cause (09)
    clinic_ranks       the clinic's FSDP2 cases on the ranks: accumulation, state dicts, tied weights, bf16

They stand on `labkit.engines` and the probes; no engine imports them. Plots, tables, widgets and
predictions, the other faces a notebook calls, are `labkit.plots`, `labkit.tables`, `labkit.widgets` and
`labkit.predict`.
"""
