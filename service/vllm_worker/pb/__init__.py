"""Generated stubs of the vLLM worker protocol (`scripts/gen_protos.sh`; never edited by hand),
from third_party/smg_grpc_proto/: `vllm_engine_pb2` (+ `_grpc`), `common_pb2` (+ `_grpc`).
May import: nothing
"""
