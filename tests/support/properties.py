"""LMI's reference serving.properties files (djl-serving's docs), one per strategy."""


# DESIGN.md's reference files, verbatim.
REF_DYNAMIC = """engine=Python
option.entryPoint=djl_python.huggingface
batch_size=64
max_batch_delay=1000
option.tensor_parallel_degree=2
"""


REF_CONTINUOUS = """engine=MPI
option.entryPoint=djl_python.huggingface
option.rolling_batch=auto
option.max_rolling_batch_size=64
option.paged_attention=false
option.max_rolling_batch_prefill_tokens=16080
option.tensor_parallel_degree=2
"""


REF_PAGED = REF_CONTINUOUS.replace("option.paged_attention=false", "option.paged_attention=true")
