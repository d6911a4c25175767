"""Parallelism applied to the single-device model (model/ never imports this package).

    state            init_parallel(tp, pp) / setup_parallel(cfg, arch) -> ParallelContext; DeepSpeedMPU
    tensor_parallel  apply_tensor_parallel(model, ctx): megatron-core TP layers, shards loaded in place
    sharded_teacher  load_tensor_parallel(ckpt, ctx): a teacher split over TP ranks, each reading its slice
    losses           vocab_parallel_kl / vocab_parallel_cross_entropy on vocabulary shards
    deepspeed_engine build_deepspeed_config, build_student_engine (ZeRO 1-3), build_teacher
    pipeline         build_pipeline_engine: DeepSpeed pipeline (ZeRO-1), student + teacher per stage

Submodules import megatron-core / deepspeed; importing this package itself does not.
"""
