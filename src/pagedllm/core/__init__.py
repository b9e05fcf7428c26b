"""The torch-free core: sequences, the block manager, the scheduler, outputs and step statistics.

Nothing here imports torch or any pagedllm package above it, so these modules test in
milliseconds and every other layer can share their data types.
"""
