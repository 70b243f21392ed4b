"""Data parallelism on PyTorch's own machinery: DDP for ZeRO stage 0, FSDP2 (``fully_shard``) for the sharded
stages, dutycycle's collectives plugged into FSDP2's comm seams, and byte accounting for all of it."""
